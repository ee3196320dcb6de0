"""The batching engine on a thread of its own: the `Engine` protocol (api.py) over `LLMEngine`.

    engine = BatchEngine(max_queue=64)                 # LOADING: submit raises EngineUnavailable
    engine.start(LLMEngine(runner, tokenizer, ...))     # READY
    engine.submit(request, sink); engine.cancel(request_id); engine.drain(30); engine.shutdown()

All locks and queues live here (the step loop in engine.py has none). Callers' threads only
put requests and cancellations into the inbox under the lock; the engine's thread moves them
into the step loop between steps and runs steps while anything is running or waiting, so a new
request joins the running batch at the next step. The events of a step reach the sinks together
when it ends (the server's sinks then wake its event loop once for all of them). Every request's
sink is guarded: after its final event nothing more reaches it, whichever thread ended it.

Errors: a `UserError` while a request is added ends that request only (it can never run here).
Any exception from a step means the ranks may no longer agree (a peer is gone, a collective
failed): the engine FAILS, every request ends with an error event, and it takes no more.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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
from hetero_run.topology.errors import UserError

log = logging.getLogger("hetero_run.runtime.engine.service")

SHUTTING_DOWN = "the server is shutting down"


@dataclass(eq=False)
class _Handle:
    request: GenerationRequest
    sink: Sink
    done: bool = False
    generated: int = 0


def _unexpected(exc: BaseException) -> str:
    """The default description of a failed step: a bug here, so its traceback goes to the log."""
    log.error("engine step failed", exc_info=exc)
    return f"{type(exc).__name__}: {exc}"


class BatchEngine:
    def __init__(self, max_queue: int = 64, describe_failure: Callable[[BaseException], str] | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self.describe_failure = describe_failure or _unexpected
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.max_context = 0
        self.algorithm = "none"
        self.engine = None  # the LLMEngine, from start()
        self._lock = threading.Condition()
        self._inbox: collections.deque[_Handle] = collections.deque()
        self._cancels: dict[str, str | None] = {}  # request -> why, for its final event
        self._live: dict[str, _Handle] = {}  # handed to the step loop, not finished
        self._thread: threading.Thread | None = None
        self._held: list[tuple[_Handle, GenerationEvent]] | None = None  # a running step's events

    def start(self, engine) -> None:
        """READY: serve through `engine` (an LLMEngine) on a new thread."""
        self.engine, self.max_context, self.algorithm = engine, engine.max_context, engine.algorithm
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
            engine = self.engine
            held = len(self._inbox) + engine.num_waiting + engine.num_running
            if held >= self.max_queue + engine.config.max_num_seqs:  # as many running as may, and a full queue
                raise QueueFull(f"{held - engine.num_running} requests are waiting (--max-queue {self.max_queue})")
            self._inbox.append(_Handle(request, sink))
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            for handle in self._inbox:
                if handle.request.request_id == request_id:
                    self._inbox.remove(handle)
                    self._final(handle, "abort")
                    return
            if request_id in self._live:
                self._cancels.setdefault(request_id, None)
                self._lock.notify_all()

    def stats(self) -> EngineStats:
        engine = self.engine
        if engine is None:
            return EngineStats(0, len(self._inbox))
        blocks = engine.blocks
        return EngineStats(engine.num_running, engine.num_waiting + len(self._inbox), blocks.num_blocks,
                           blocks.num_free, blocks.block_size)

    def drain(self, timeout: float) -> bool:
        """Refuse new requests; let queued and running ones finish for up to `timeout` seconds,
        then abort the rest. True when none had to be aborted."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if self.state in (EngineState.READY, EngineState.LOADING):
                self.state = EngineState.DRAINING
            self._lock.notify_all()
            while self._busy() and self.state is EngineState.DRAINING:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            finished = not self._busy()
            self._abort_everything(SHUTTING_DOWN)
        return finished

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine's thread; anything left ends "abort" (within one step, bounded by `timeout`)."""
        with self._lock:
            if self.state is not EngineState.FAILED:
                self.state = EngineState.STOPPED
            self._abort_everything(SHUTTING_DOWN)
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def fail(self, reason: str) -> None:
        """Every request ends with an error now, from the calling thread, even while the engine's
        thread is stuck in a collective; nothing more is taken."""
        with self._lock:
            if self.state is EngineState.FAILED:
                return
            self.state, self.error = EngineState.FAILED, reason
            for handle in [*self._inbox, *self._live.values()]:
                self._final(handle, "error", reason)
            self._inbox.clear()
            self._lock.notify_all()
        log.error("engine failed: %s", reason)

    # -- the engine's thread ---------------------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._inbox or self._live)

    def _abort_everything(self, reason: str) -> None:
        """(Lock held.) Queued requests end now; running ones at the next step."""
        while self._inbox:
            self._final(self._inbox.popleft(), "abort", reason)
        for request_id in self._live:
            self._cancels[request_id] = reason

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                while (not self._inbox and not self._cancels and not engine.has_work()
                       and self.state in (EngineState.READY, EngineState.DRAINING)):
                    self._lock.wait()
                if self.state is EngineState.FAILED:
                    return
                if self.state is EngineState.STOPPED and not engine.has_work() and not self._inbox:
                    return
                arrivals, cancels = list(self._inbox), dict(self._cancels)
                self._inbox.clear()
                self._cancels.clear()
            try:
                for handle in arrivals:
                    self._add(handle)
                for request_id, why in cancels.items():
                    engine.cancel(request_id, why)
                if engine.has_work():
                    self._held = []
                    try:
                        engine.step()
                    finally:  # a step's events go out together: the loop they wake takes them all at once
                        held, self._held = self._held, None
                        for handle, event in held:
                            self._deliver(handle, event)
            except BaseException as exc:  # the ranks may disagree now: nothing more runs
                log.debug("engine step failed", exc_info=True)
                self.fail(self.describe_failure(exc))
                return
            with self._lock:
                self._lock.notify_all()  # a drain may be waiting for the last request

    def _add(self, handle: _Handle) -> None:
        with self._lock:
            if handle.done:
                return
            self._live[handle.request.request_id] = handle
        try:
            self.engine.add(handle.request, lambda event, h=handle: self._sink(h, event))
        except UserError as exc:  # this request can never run here; the others go on
            with self._lock:
                self._final(handle, "error", str(exc))

    def _sink(self, handle: _Handle, event: GenerationEvent) -> None:
        """The engine's sink for `handle`: during a step the event waits for the step's end."""
        if self._held is not None:
            self._held.append((handle, event))
        else:
            self._deliver(handle, event)

    def _deliver(self, handle: _Handle, event: GenerationEvent) -> None:
        with self._lock:
            if handle.done:
                return
            handle.generated += len(event.token_ids)
            if event.final:
                handle.done = True
                self._live.pop(handle.request.request_id, None)
            handle.sink(event)

    def _final(self, handle: _Handle, reason: str, error: str | None = None) -> None:
        """(Lock held.) End a request that the step loop did not end itself."""
        if handle.done:
            return
        handle.done = True
        self._live.pop(handle.request.request_id, None)
        usage = Usage(handle.request.prompt_tokens, handle.generated)
        handle.sink(GenerationEvent(handle.request.request_id, "", (), reason, error, usage))
