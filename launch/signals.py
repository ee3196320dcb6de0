"""SIGINT / SIGTERM: unwind the main thread so teardown runs, and never hang doing it."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from hetero_run.launch.log import get_logger
from hetero_run.launch.watchdog import exit_now, note_signal, probe_peers

log = get_logger(__name__)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; unwinds the stack so teardown runs."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def unwind_on_signals(grace_s: float) -> Iterator[None]:
    """SIGINT/SIGTERM raise `Interrupted` in the main thread.

    The main thread may be blocked inside a collective, where Python cannot run the handler.
    The signal still reaches a wake-up pipe at C level, so a watcher thread sees it and ends
    the process after `grace_s` if the unwinding has not finished by then.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    done = threading.Event()

    said = threading.Lock()

    def announce(signum: int) -> None:
        """Log the signal once, from whichever thread sees it first."""
        if said.acquire(blocking=False):
            note_signal(signum)
            log.warning("received %s; shutting down", signal.Signals(signum).name)

    def watch():
        while not done.is_set():
            try:
                data = os.read(read_fd, 1)
            except OSError:
                return
            if not data:
                return
            signum = data[0]
            # Said here, at once: the main thread may be blocked in a collective, and mpirun
            # follows its SIGTERM with SIGKILL about 0.25 s later.
            announce(signum)
            if done.is_set():
                return
            probe_peers()  # a peer's death may be why: name it before mpirun's SIGKILL
            if done.wait(grace_s):
                return
            exit_now(
                f"{signal.Signals(signum).name} received; shutdown did not finish within "
                f"{grace_s:g} s, exiting",
                code=128 + signum,
            )

    fired = threading.Event()

    def handler(signum, _frame):
        if fired.is_set():
            return  # already unwinding; a second exception would cut teardown short
        fired.set()
        announce(signum)  # the watcher may not get to it before the unwinding ends
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="signal-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous_fd)
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(write_fd)  # wakes the watcher: read returns b""
        watcher.join(timeout=1.0)
        os.close(read_fd)


