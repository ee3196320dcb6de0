"""The server app in process over a scripted engine, for tests/launch/server: the engine, an
httpx client on the app's ASGI transport, and readers of error bodies and SSE streams.

    from app_support import CHAT, ScriptedEngine, error_of, parse_sse, post, run
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import speculative_support as support

from hetero_run.launch.server.app import ServerSettings, create_app
from hetero_run.launch.server.metrics import Metrics
from hetero_run.launch.server.prompts import Prompter
from hetero_run.runtime.engine.api import (
    EngineState,
    EngineStats,
    GenerationEvent,
    QueueFull,
    SpeculationSummary,
    TokenLogprob,
    Usage,
)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class ScriptedEngine:
    """Answers every request with `pieces` of text (one token each), then `finish`."""

    def __init__(self):
        self.state, self.error, self.max_context, self.algorithm = EngineState.READY, None, 64, "slem"
        self.pieces, self.finish, self.full = ["Hel", "lo", " wörld"], "length", False
        self.requests, self.cancelled = [], []
        self.tokenizer = None  # the target's tokenizer the app encodes with (None: support.byte_level())
        self.token_ids = None  # each piece's token id (None: 7 for every piece)
        self.answer = None  # request -> (pieces, finish) for that request (None: pieces and finish)
        self.room = None  # requests it still takes before QueueFull (None: no limit)

    def submit(self, request, sink):
        if self.full or self.room == 0:
            raise QueueFull("1 requests are waiting (--max-queue 1)")
        if self.room is not None:
            self.room -= 1
        self.requests.append(request)
        pieces, finish = self.answer(request) if self.answer else (self.pieces, self.finish)

        def run():
            offset = 0
            for j, piece in enumerate(pieces):
                token = self.token_ids[j] if self.token_ids else 7
                sink(GenerationEvent(request.request_id, piece, (token,), logprobs=self.logprobs(request, j, offset),
                                     prompt_logprobs=self.prompt_logprobs(request) if j == 0 else ()))
                offset += len(piece)
            summary = SpeculationSummary("slem", 2, 1, 3, 1, (1,))
            sink(GenerationEvent(request.request_id, "", (), finish, "boom" if finish == "error" else None,
                                 Usage(request.prompt_tokens, len(pieces)), summary))

        threading.Thread(target=run).start()

    def logprobs(self, request, j: int, offset: int) -> tuple:
        """With request.logprobs: piece j's token at log-probability -(j + 1) / 4, its top k the token
        itself, then ids 100, 101, ... each a unit less likely."""
        if request.logprobs is None:
            return ()
        token, lp = self.token_ids[j] if self.token_ids else 7, -(j + 1) / 4
        top = ((token, lp), *((100 + d, lp - 1 - d) for d in range(request.logprobs - 1)))[:request.logprobs]
        return (TokenLogprob(token, lp, top, offset),)

    def prompt_logprobs(self, request) -> tuple:
        """With request.prompt_logprobs: prompt token q (from 1) at -q / 8, its top k the token
        itself, then ids 100, 101, ..."""
        k = request.prompt_logprobs
        if k is None:
            return ()
        ids = request.prompt.target_ids
        return tuple(TokenLogprob(ids[q], -q / 8, ((ids[q], -q / 8), *((100 + d, -q / 8 - 1 - d) for d in range(k - 1)))
                                  [:k]) for q in range(1, len(ids)))

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def stats(self):
        return EngineStats(0, 0, 64, 60)


def client_for(engine, **settings) -> httpx.AsyncClient:
    app = create_app(engine, ServerSettings(model="tiny", **settings), Metrics(engine))
    tokenizer = engine.tokenizer or support.byte_level()
    app.state.prompter = Prompter(tokenizer, {tokenizer.eos_token_id})
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def post(engine, path, body, headers=None, **settings) -> httpx.Response:
    async with client_for(engine, **settings) as client:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await client.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})


def run(coro):
    return asyncio.run(coro)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]



def parse_sse(text: str) -> list:
    assert text.endswith("\n\n")
    frames = text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), frames
    return [f[6:] if f[6:] == "[DONE]" else json.loads(f[6:]) for f in frames]
