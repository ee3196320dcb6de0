"""The engine that serves requests one at a time, in arrival order, on a thread of its own.

    engine = SerialEngine(max_queue=64)                      # LOADING: submit raises EngineUnavailable
    engine.start(decoder, meter, decode, max_context=4096)   # READY
    engine.submit(request, sink); engine.cancel(request_id); engine.drain(30); engine.shutdown()

Each request runs through a `Decoder` (the target alone or the speculative engine, exactly as
`hetero-run generate` runs them) over a `RoundMeter` wrapping the target runner. The decoder
reports the tokens of every round through `on_tokens`; there the engine turns them into text
(`OutputText`), hands the event to the request's sink and, when the request was cancelled or a
stop string appeared, raises `_Finished`, which unwinds the decoder between two rounds. After
every request the target's KV cache is truncated to empty.

Errors: a `UserError` from the decoder (e.g. the KV cache is full) ends that request only. Any
other exception means the ranks may no longer agree (a peer is gone, a collective failed):
the engine FAILS, every request ends with an error event, and it takes no more.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hetero_run.runtime.engine.api import (
    EngineState,
    EngineStats,
    EngineUnavailable,
    GenerationEvent,
    GenerationRequest,
    QueueFull,
    Sink,
    Usage,
)
from hetero_run.runtime.engine.meter import RoundMeter
from hetero_run.runtime.engine.output import OutputText
from hetero_run.topology.errors import UserError

log = logging.getLogger("hetero_run.runtime.engine.serial")

SHUTTING_DOWN = "the server is shutting down"


class Decoder(Protocol):
    """What `hetero-run generate` decodes with (launch/generate.py `Decoder`)."""

    algorithm: str
    sampling: object  # kernels.sampling.SamplingParams for the next generate(); set per request

    def generate(self, prompt, max_new_tokens: int, stop_ids: set[int],
                 on_tokens: Callable[[list[int]], None]) -> dict: ...


class _Finished(Exception):
    """Raised from on_tokens to end a generation between two rounds."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclass(eq=False)
class _Active:
    request: GenerationRequest
    sink: Sink
    cancelled: bool = False
    done: bool = False  # the final event was handed over
    token_ids: list[int] = field(default_factory=list)


class SerialEngine:
    def __init__(self, max_queue: int = 64, describe_failure: Callable[[BaseException], str] | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self.describe_failure = describe_failure or (lambda exc: f"{type(exc).__name__}: {exc}")
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.max_context = 0
        self.algorithm = "none"
        self._lock = threading.Condition()
        self._queue: collections.deque[_Active] = collections.deque()
        self._running: _Active | None = None
        self._thread: threading.Thread | None = None

    def start(self, decoder: Decoder, meter: RoundMeter, decode: Callable[[Sequence[int]], str],
              max_context: int) -> None:
        """READY: `decode(ids) -> text` is the target tokenizer's (special tokens skipped)."""
        self.decoder, self.meter, self.decode = decoder, meter, decode
        self.max_context, self.algorithm = max_context, decoder.algorithm
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        with self._lock:
            if self.state is EngineState.LOADING:
                self.state = EngineState.READY
        self._thread.start()

    # -- called from any thread ------------------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        with self._lock:
            if self.state is not EngineState.READY:
                raise EngineUnavailable(self.error or f"the engine is {self.state.value}")
            if len(self._queue) + (self._running is not None) > self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (--max-queue {self.max_queue})")
            self._queue.append(_Active(request, sink))
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._running is not None and self._running.request.request_id == request_id:
                self._running.cancelled = True
                return
            for active in self._queue:
                if active.request.request_id == request_id:
                    self._queue.remove(active)
                    self._finish(active, "abort")
                    return

    def stats(self) -> EngineStats:
        with self._lock:
            running, waiting = int(self._running is not None), len(self._queue)
        used = getattr(self, "meter", None)
        used = used.length if used is not None else 0
        return EngineStats(running, waiting, self.max_context, max(0, self.max_context - used))

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            if self.state in (EngineState.READY, EngineState.LOADING):
                self.state = EngineState.DRAINING
            self._lock.notify_all()
            while (self._queue or self._running) and self.state is EngineState.DRAINING:
                if not self._lock.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    break
            finished = not (self._queue or self._running)
            while self._queue:
                self._finish(self._queue.popleft(), "abort", SHUTTING_DOWN)
            if self._running is not None:
                self._running.cancelled = True
        return finished

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine's thread: a running request stops within one round (bounded by `timeout`)."""
        with self._lock:
            if self.state is not EngineState.FAILED:
                self.state = EngineState.STOPPED
            while self._queue:
                self._finish(self._queue.popleft(), "abort", SHUTTING_DOWN)
            if self._running is not None:
                self._running.cancelled = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.state is EngineState.FAILED:
                return
            self.state, self.error = EngineState.FAILED, reason
            for active in [*self._queue, *([self._running] if self._running else [])]:
                active.cancelled = True
                self._finish(active, "error", reason)
            self._queue.clear()
            self._lock.notify_all()
        log.error("engine failed: %s", reason)

    # -- the engine's thread ---------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and self.state in (EngineState.READY, EngineState.DRAINING):
                    self._lock.wait()
                if not self._queue:
                    return
                active = self._running = self._queue.popleft()
            try:
                self._serve(active)
            except BaseException as exc:  # the ranks may disagree now: nothing more runs
                log.debug("engine step failed", exc_info=True)
                self.fail(self.describe_failure(exc))
                return
            finally:
                with self._lock:
                    self._running = None
                    self._lock.notify_all()

    def _serve(self, active: _Active) -> None:
        request = active.request
        text = OutputText(self.decode, request.stop_strings)
        self.meter.reset()
        error = None

        def on_tokens(ids: list[int]) -> None:
            active.token_ids += ids
            self._emit(active, GenerationEvent(request.request_id, text.add(ids), tuple(ids)))
            if text.stopped:
                raise _Finished("stop")
            if active.cancelled:
                raise _Finished("abort")

        if active.cancelled:
            reason = "abort"
        else:
            self.decoder.sampling = request.sampling
            try:
                self.decoder.generate(request.prompt, request.max_new_tokens, set(request.stop_ids), on_tokens)
                ends = active.token_ids and active.token_ids[-1] in request.stop_ids
                reason = "stop" if ends else "length"
            except _Finished as finished:
                reason = finished.reason
            except UserError as exc:  # raised on rank 0 before anything was sent: the ranks still agree
                reason, error = "error", str(exc)
            # any other exception propagates: the ranks may be out of step, so nothing more is sent
            if self.meter.length:
                self.meter.truncate(0)
        rest = text.finish() if reason in ("stop", "length") else ""
        usage = Usage(request.prompt_tokens, len(active.token_ids))
        self._finish(active, reason, error, rest, usage, self.meter.summary(self.algorithm))

    # -- events ------------------------------------------------------------------------------

    def _emit(self, active: _Active, event: GenerationEvent) -> None:
        with self._lock:
            if not active.done:
                active.sink(event)

    def _finish(self, active: _Active, reason: str, error: str | None = None, text: str = "",
                usage: Usage | None = None, speculation=None) -> None:
        with self._lock:
            if active.done:
                return
            active.done = True
            usage = usage or Usage(active.request.prompt_tokens, len(active.token_ids))
            active.sink(GenerationEvent(active.request.request_id, text, (), reason, error, usage, speculation))
