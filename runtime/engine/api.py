"""What callers (the HTTP server, `generate`) and the engine exchange: requests in, events out.

    engine.submit(request, sink)   # thread-safe, returns at once; raises QueueFull past --max-queue
    engine.cancel(request_id)      # thread-safe; that request ends with finish_reason "abort"
                                   # within one engine step, and its KV cache is freed
    sink(event)                    # in order, per request: zero or more delta events, then exactly
                                   # one final event (finish_reason set); never after the final event
    engine.drain(timeout)          # refuse new requests (DRAINING); let queued and running ones finish
                                   # for up to `timeout` s, then abort the rest; -> True if none was aborted
    engine.shutdown()              # stop the engine's thread (STOPPED); anything left ends "abort"
    engine.fail(reason)            # a peer is lost: every request ends "error" now, from the calling
                                   # thread, even while the engine's thread is stuck in a collective (FAILED)

The engine runs every model call on one thread of its own and calls sinks there; final events of
requests that never started (cancelled while queued, drained, failed) may come from the thread
that ended them. `sink` must only hand the event over, thread-safely and without blocking (e.g.
`loop.call_soon_threadsafe(queue.put_nowait, event)`).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.speculative.prompt import Prompt

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: Prompt  # target_ids set by the caller (chat template applied); messages or text for the drafter
    max_new_tokens: int
    sampling: SamplingParams  # a sampled request carries its seed (None: a random one)
    stop_ids: frozenset[int] = frozenset()  # end-of-sequence tokens: generation ends after one, its text not shown
    stop_strings: tuple[str, ...] = ()  # generation ends at the first match; the text is cut just before it
    arrival: float = field(default_factory=time.monotonic)
    logprobs: int | None = None  # None: none; k >= 0: each output token's log-probability and the k likeliest
    prompt_logprobs: int | None = None  # the same for the prompt's tokens from the second on (vLLM's name)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.target_ids or ())


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True)
class SpeculationSummary:
    """One request's speculation, in vLLM's terms: a draft is a round that verified draft tokens."""

    algorithm: str  # what was configured ("auto" included)
    rounds: int  # target forwards that decided tokens for this request
    drafts: int  # rounds that verified at least one draft token
    draft_tokens: int  # draft tokens verified
    accepted_tokens: int  # of them accepted
    # accepted_per_position[j]: rounds whose draft token at depth j + 1 was accepted (vLLM's
    # spec_decode_num_accepted_tokens_per_pos); it sums to accepted_tokens and never rises with j
    accepted_per_position: tuple[int, ...] = ()

    @property
    def tokens_per_round(self) -> float:
        return 0.0 if not self.rounds else (self.rounds + self.accepted_tokens) / self.rounds

    def to_json(self) -> dict:
        return {"algorithm": self.algorithm, "rounds": self.rounds, "drafts": self.drafts,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "tokens_per_round": round(self.tokens_per_round, 4),
                "accepted_per_position": list(self.accepted_per_position)}


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target's own distribution at its position (the
    log-softmax of its logits, before temperature, top-k and top-p: vLLM's default), the `top`
    likeliest tokens there as (id, log-probability), likeliest first, and where the token's text
    starts in the request's output text (characters)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    offset: int = 0


@dataclass(frozen=True)
class GenerationEvent:
    request_id: str
    text: str = ""  # new text since the last event: whole characters, nothing from a stop string on
    token_ids: tuple[int, ...] = ()  # new target tokens since the last event
    finish_reason: str | None = None  # None while running; one of FINISH_REASONS on the final event
    error: str | None = None  # with finish_reason "error": what went wrong, for the client
    usage: Usage | None = None  # on the final event
    speculation: SpeculationSummary | None = None  # on the final event
    # with request.logprobs: the tokens whose text this event released (a token whose characters
    # are all held back comes with a later event; the tokens of a stop string never come)
    logprobs: tuple[TokenLogprob, ...] = ()
    # with request.prompt_logprobs, on the event of the first output token: prompt tokens 1 .. n - 1
    # (the first has none), their offsets 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


Sink = Callable[[GenerationEvent], None]


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # running requests finish, new ones are refused
    STOPPED = "stopped"
    FAILED = "failed"  # a peer rank was lost or a step raised: see Engine.error


class QueueFull(Exception):
    """More requests are waiting than the engine queues (--max-queue)."""


class EngineUnavailable(Exception):
    """The engine is not taking requests (loading, draining, stopped or failed)."""


@dataclass(frozen=True)
class EngineStats:
    running: int  # requests being generated
    waiting: int  # requests queued
    kv_blocks_total: int = 0  # KV cache capacity in blocks of `block_size` tokens
    kv_blocks_free: int = 0
    block_size: int = 1

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache in use, 0..1."""
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Engine(Protocol):
    state: EngineState
    error: str | None  # why the engine FAILED (names the lost rank), else None
    max_context: int  # prompt + generated tokens one request may hold
    algorithm: str  # the configured speculative algorithm ("none" without one)

    def submit(self, request: GenerationRequest, sink: Sink) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def drain(self, timeout: float) -> bool: ...

    def shutdown(self) -> None: ...

    def fail(self, reason: str) -> None: ...
