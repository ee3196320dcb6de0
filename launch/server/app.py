"""The routes: OpenAI's chat and completions (streamed or not), models, health, metrics, version,
and vLLM's /tokenize and /detokenize.

    app = create_app(engine, ServerSettings(model="qwen"), metrics)
    app.state.prompter = Prompter(tokenizer, stop_ids)   # once the model is loaded

Every request: auth (/v1, /tokenize, /detokenize) -> body size -> JSON and field validation ->
model name -> the prompt rendered in a worker thread -> the context check -> `engine.submit` with
a `Channel`.
A disconnect watcher cancels the request as soon as the client goes, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.launch.server import protocol, tools
from hetero_run.launch.server.errors import APIError, bad_request, unavailable
from hetero_run.launch.server.sse import DONE, Channel, Mailbox, event
from hetero_run.runtime.engine.api import (
    EngineState,
    EngineUnavailable,
    GenerationRequest,
    QueueFull,
    SpeculationSummary,
    Usage,
)

log = logging.getLogger("hetero_run.launch.server")


@dataclass(frozen=True)
class ServerSettings:
    model: str  # --served-model-name
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    allowed_origins: tuple[str, ...] = ()
    log_requests: bool = False
    version: str = ""
    extra_version: dict = field(default_factory=dict)


STATE_MESSAGES = {EngineState.LOADING: "the model is loading", EngineState.DRAINING: "the server is shutting down",
                  EngineState.STOPPED: "the server has stopped"}


def create_app(engine, settings: ServerSettings, metrics) -> FastAPI:
    app = FastAPI(title="hetero-run", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.prompter = None
    app.state.open_requests = 0
    app.state.mailbox = None  # the event loop's Mailbox, made on the loop's first request
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return APIError(exc.status_code, message).response()

    def mailbox() -> Mailbox:
        loop = asyncio.get_running_loop()
        if app.state.mailbox is None or app.state.mailbox.loop is not loop:
            app.state.mailbox = Mailbox(loop)
        return app.state.mailbox

    def unavailable_error() -> APIError:
        return unavailable(engine.error if engine.state is EngineState.FAILED else STATE_MESSAGES[engine.state])

    @app.get("/health")
    async def health():
        if engine.state is EngineState.READY:
            return {"status": "ok"}
        return unavailable_error().response()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return {"version": settings.version, "model": settings.model, "state": engine.state.value,
                "algorithm": engine.algorithm, **settings.extra_version}

    @app.get("/v1/models")
    async def models(request: Request):
        _authorise(request, settings.api_key)
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "hetero-run", "max_model_len": engine.max_context or None}]}

    async def _tokenizer_request(request: Request, kind):
        _authorise(request, settings.api_key)
        req = protocol.parse(kind, await _read_body(request, settings.max_body_bytes))
        _check_model(req.model, settings.model)
        if app.state.prompter is None:
            raise unavailable_error()
        return req, app.state.prompter

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req, prompter = await _tokenizer_request(request, protocol.TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt (text) and messages (a conversation)", "prompt")
        if req.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
            conversation = protocol.conversation(req.messages)
            ids = list((await run_in_threadpool(prompter.chat, conversation, tools)).target_ids)
        else:
            ids = await run_in_threadpool(prompter.tokenize, req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_context or None, "tokens": ids,
                "token_strs": prompter.token_strings(ids) if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req, prompter = await _tokenizer_request(request, protocol.DetokenizeRequest)
        return {"prompt": await run_in_threadpool(prompter.detokenize, req.tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, protocol.ChatRequest, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, protocol.CompletionRequest, chat=False)

    async def _serve(request: Request, kind, chat: bool):
        arrival = time.monotonic()
        _authorise(request, settings.api_key)
        body = await _read_body(request, settings.max_body_bytes)
        try:
            req = protocol.parse(kind, body)
            _check_model(req.model, settings.model)
            if engine.state is not EngineState.READY or app.state.prompter is None:
                raise unavailable_error()
            prompter = app.state.prompter
            render = partial(prompter.chat, req.conversation(), req.offered_tools) if chat else \
                partial(prompter.completion, req.prompt)
            prompt = await run_in_threadpool(render)
            if req.wanted_logprobs is not None:
                await run_in_threadpool(prompter.piece, 0)  # the token table, built once, off the event loop
            generation = _generation_request(req, prompt, prompter, engine.max_context,
                                             "messages" if chat else "prompt", arrival)
        except APIError as exc:
            metrics.rejected.labels("invalid" if exc.status < 500 else "unavailable").inc()
            raise
        ids = protocol.ResponseIds("chatcmpl" if chat else "cmpl", settings.model)
        channels = []
        try:
            for i in range(req.choices):
                one = _choice(generation, ids.id, i, req.choices)
                channel = Channel(mailbox(), metrics.timer(arrival).observe)
                engine.submit(one, channel.sink)
                channels.append(channel)
        except (QueueFull, EngineUnavailable) as exc:
            for i in range(len(channels)):  # the choices already queued go too
                engine.cancel(_choice_id(ids.id, i, req.choices))
            if isinstance(exc, QueueFull):
                metrics.rejected.labels("queue_full").inc()
                raise APIError(429, f"the server is busy: {exc}") from None
            metrics.rejected.labels("unavailable").inc()
            raise unavailable(str(exc)) from None
        if settings.log_requests:
            log.info("%s: prompt %r", ids.id, generation.prompt.messages or generation.prompt.text
                     or list(generation.prompt.target_ids))
        respond = _stream if req.stream else _complete
        echo = "" if chat or not req.echo else \
            req.prompt if isinstance(req.prompt, str) else app.state.prompter.detokenize(req.prompt)
        return await respond(request, req, ids, channels, chat, generation.prompt.target_ids, echo)

    def _cancel_all(ids, channels) -> None:
        for i, channel in enumerate(channels):
            if not channel.finished:
                engine.cancel(_choice_id(ids.id, i, len(channels)))

    async def _complete(request, req, ids, channels: list[Channel], chat: bool, prompt_ids, echo: str):
        app.state.open_requests += 1
        watcher = asyncio.create_task(_watch_disconnect(request, lambda: _cancel_all(ids, channels)))

        async def collect(channel: Channel):
            texts, tokens, entries, prompt = [], [], [], []
            while True:
                ev = await channel.next()
                texts.append(ev.text)
                tokens += ev.token_ids
                entries += ev.logprobs
                prompt += ev.prompt_logprobs
                if ev.final:
                    return "".join(texts), tokens, (entries, prompt), ev

        try:
            results = await asyncio.gather(*(collect(channel) for channel in channels))
        finally:
            watcher.cancel()
            app.state.open_requests -= 1
            _cancel_all(ids, channels)
        for text, _, _, ev in results:
            _log_output(ids, ev, text)
        failed = next((ev for *_, ev in results if ev.finish_reason not in ("stop", "length")), None)
        if failed is not None:
            raise _final_error(failed)
        choices = []
        scores_only = req.scores_only
        for i, (text, tokens, (entries, prompt_entries), ev) in enumerate(results):
            if scores_only:  # the token the prompt's last row decided is not part of the answer
                text, tokens, entries, ev = "", [], [], replace(ev, finish_reason="length")
            logprobs = None if req.wanted_logprobs is None else \
                _logprobs(entries, chat, prompt_entries, prompt_ids, echo)
            token_ids = tokens if req.return_token_ids else None
            if chat:
                content, calls = tools.parse(text, req.tool_names) if req.offered_tools else (text, [])
                choices.append(protocol.chat_choice(i, content, _finish(ev.finish_reason, bool(calls)), calls,
                                                    logprobs, token_ids))
            else:
                choices.append(protocol.completion_choice(i, echo + text, ev.finish_reason, logprobs, token_ids))
        finals = [ev for *_, ev in results]
        respond = protocol.chat_response if chat else protocol.completion_response
        return JSONResponse(respond(ids, choices, _usage(finals, scores_only), _speculation(finals),
                                    prompt_ids if req.return_token_ids else None))

    def _logprobs(entries, chat: bool, prompt_entries=(), prompt_ids=(), echo: str = "") -> dict:
        """OpenAI's logprobs object of output `entries` (with echo: after the prompt's tokens)."""
        piece = app.state.prompter.piece
        if chat:
            return protocol.chat_logprobs(entries, piece)
        prompt = (prompt_ids[0], prompt_entries) if echo and prompt_ids else None
        return protocol.completion_logprobs(entries, piece, prompt, len(echo))

    async def _stream(request, req, ids, channels: list[Channel], chat: bool, prompt_ids, echo: str):
        usage = req.include_usage
        obj = "chat.completion.chunk" if chat else "text_completion"
        n = len(channels)
        calls = [tools.CallStream(req.tool_names) if chat and req.offered_tools else None for _ in range(n)]
        scores_only = req.scores_only  # the token decided after the prompt is not shown

        def chunks(i: int, text: str, entries=(), final: bool = False) -> list[bytes]:
            """The frames of choice i's event; its tokens' log-probabilities ride on the first."""
            logprobs = _logprobs(entries, chat, echo=echo) if entries and req.wanted_logprobs is not None else None
            if not chat:
                return [event(protocol.completion_chunk(ids, text, None, usage, logprobs=logprobs, index=i))] \
                    if text or logprobs else []
            deltas = [{"content": text}] if calls[i] is None and text else []
            if calls[i] is not None:
                deltas = calls[i].feed(text) + (calls[i].finish() if final else [])
            if logprobs and not deltas:
                deltas = [{}]
            return [event(protocol.chat_chunk(ids, delta, None, usage, logprobs=logprobs if j == 0 else None,
                                              index=i)) for j, delta in enumerate(deltas)]

        def last(i: int, finish: str, speculation) -> bytes:
            if chat:
                finish = _finish(finish, bool(calls[i] and calls[i].calls))
                return event(protocol.chat_chunk(ids, {}, finish, usage, speculation, index=i))
            return event(protocol.completion_chunk(ids, "", finish, usage, speculation, index=i))

        async def merged():
            """(choice, event) as the choices' events arrive, each choice's in order, until every one ended."""
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, channel: Channel):
                while True:
                    ev = await channel.next()
                    await queue.put((i, ev))
                    if ev.final:
                        return

            pumps = [asyncio.create_task(pump(i, channel)) for i, channel in enumerate(channels)]
            try:
                for _ in channels:
                    while True:
                        i, ev = await queue.get()
                        yield i, ev
                        if ev.final:
                            break
            finally:
                for task in pumps:
                    task.cancel()

        async def frames():
            app.state.open_requests += 1
            watcher = asyncio.create_task(_watch_disconnect(request, lambda: _cancel_all(ids, channels)))
            texts: list[list[str]] = [[] for _ in range(n)]
            finals = []
            try:
                for i in range(n):
                    if chat:
                        yield event(protocol.chat_chunk(ids, {"role": "assistant", "content": ""}, None, usage,
                                                        index=i))
                echoed = [not echo] * n  # a choice's echo goes with its first event, the prompt's figures with it
                async with contextlib.aclosing(merged()) as stream:
                    async for i, ev in stream:
                        if not echoed[i]:
                            echoed[i] = True
                            logprobs = None if req.wanted_logprobs is None else \
                                _logprobs((), chat, ev.prompt_logprobs, prompt_ids, echo)
                            yield event(protocol.completion_chunk(ids, echo, None, usage, logprobs=logprobs, index=i))
                        texts[i].append(ev.text)
                        if not ev.final:
                            for frame in () if scores_only else chunks(i, ev.text, ev.logprobs):
                                yield frame
                            continue
                        _log_output(ids, ev, "".join(texts[i]))
                        if ev.finish_reason not in ("stop", "length"):
                            yield event(_final_error(ev).body())
                            break
                        for frame in () if scores_only else chunks(i, ev.text, ev.logprobs, final=True):
                            yield frame
                        yield last(i, "length" if scores_only else ev.finish_reason, ev.speculation)
                        finals.append(ev)
                    else:
                        if usage:
                            yield event(protocol.usage_chunk(ids, obj, _usage(finals, scores_only)))
                yield DONE
            finally:
                watcher.cancel()
                app.state.open_requests -= 1
                _cancel_all(ids, channels)

        return StreamingResponse(frames(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _final_error(ev) -> APIError:
        if ev.finish_reason == "abort" or engine.state is EngineState.FAILED:
            return unavailable(ev.error or unavailable_error().message)
        return APIError(500, ev.error or "generation failed")

    def _log_output(ids, ev, text: str) -> None:
        if settings.log_requests:
            log.info("%s: %s, %d tokens: %r", ids.id, ev.finish_reason, ev.usage.completion_tokens if ev.usage else 0,
                     text)

    return app


def _choice_id(request_id: str, i: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{i}"


def _choice(generation: GenerationRequest, request_id: str, i: int, n: int) -> GenerationRequest:
    """Choice i of n as an engine request: a seeded request's choice i draws with seed + i."""
    sampling = generation.sampling
    if n > 1 and sampling.seed is not None:
        sampling = replace(sampling, seed=sampling.seed + i)
    return replace(generation, request_id=_choice_id(request_id, i, n), sampling=sampling)


def _usage(finals, scores_only: bool = False) -> Usage:
    """The request's usage over its choices: the prompt once (and its cached tokens as the first
    choice found them), the completions summed (none when only the prompt was scored)."""
    first = finals[0].usage
    completion = 0 if scores_only else sum(ev.usage.completion_tokens for ev in finals)
    return Usage(first.prompt_tokens, completion, first.cached_tokens)


def _speculation(finals) -> SpeculationSummary | None:
    summaries = [ev.speculation for ev in finals if ev.speculation is not None]
    if not summaries:
        return None
    fields = ("rounds", "drafts", "draft_tokens", "accepted_tokens")
    positions = [0] * max(len(s.accepted_per_position) for s in summaries)
    for s in summaries:
        for j, count in enumerate(s.accepted_per_position):
            positions[j] += count
    return SpeculationSummary(summaries[0].algorithm, *(sum(getattr(s, f) for s in summaries) for f in fields),
                              tuple(positions))


def _check_model(asked: str | None, served: str) -> None:
    if asked is not None and asked != served:
        raise APIError(404, f"the model '{asked}' does not exist (this server serves '{served}')", "model",
                       "model_not_found")


def _finish(reason: str, called: bool) -> str:
    """OpenAI's finish_reason "tool_calls" for an answer that ended by itself after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def _generation_request(req, prompt, prompter, max_context: int, param: str, arrival: float) -> GenerationRequest:
    n = len(prompt.target_ids)
    room = max_context - n + 1  # the last token is never forwarded, so it needs no cache slot
    if room < 1 or (req.new_tokens is not None and req.new_tokens > room):
        asked = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        wants = f" and {asked} asks for {req.new_tokens}" if req.new_tokens is not None else ""
        raise bad_request(f"the prompt has {n} tokens{wants}, but the context holds {max_context} tokens "
                          "(prompt + new tokens - 1 must fit)", param, n_prompt_tokens=n, n_ctx=max_context)
    new = req.new_tokens if req.new_tokens is not None else room
    new = max(new, 1)  # scoring a prompt (max_tokens 0): its last row decides a token anyway, not shown
    try:
        sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, top_k=max(0, req.top_k or 0),
                                  seed=req.seed)
    except Exception as exc:
        raise bad_request(str(exc)) from None
    stop_ids = frozenset() if req.ignore_eos else prompter.stop_ids
    if req.stop_token_ids:
        stop_ids |= frozenset(prompter.checked_ids(req.stop_token_ids, "stop_token_ids"))
    return GenerationRequest("", prompt, new, sampling, stop_ids, req.stop_strings, arrival, req.wanted_logprobs,
                             req.wanted_prompt_logprobs)


def _authorise(request: Request, key: str | None) -> None:
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'", None,
                       "invalid_api_key")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body has {declared} bytes; this server takes at most {limit} (--max-body-bytes)")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"the body is over {limit} bytes (--max-body-bytes)")
    return bytes(body)


async def _watch_disconnect(request: Request, on_disconnect) -> None:
    """Wait for the client to go away (the body is read by now), then call `on_disconnect`."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # the connection is gone some other way: the request ends either way
        on_disconnect()
