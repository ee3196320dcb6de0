"""Peer liveness: a heartbeat on its own gloo group, independent of what the main thread does.

Rank 0 pings every other rank each interval and each answers; a peer that dies (its socket
closes) or goes silent for the timeout (a cable pulled, a host frozen) ends this process at
once with a message naming it. The main thread can be blocked inside a collective that will
never finish, so the heartbeat ends the process itself rather than raising.

Stopping is coordinated, so shutdown never looks like a failure: a rank that stops answers
its next ping with STOP; when rank 0 stops it sends STOP to all and waits for the answers.
A rank leaving after an error or a signal sends ABORT instead. Its peers are then likely
blocked in a collective with it that gloo cannot interrupt, so a peer that does not itself
stop within `ABORT_GRACE_S` ends its process, naming the rank that left.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import NoReturn

from hetero_run.launch.log import get_logger

log = get_logger(__name__)

ALIVE, STOP, ABORT = 0, 1, 2
ABORT_GRACE_S = 5.0  # for a rank's own unwinding to reach stop() after a peer aborted

# Set by the signal watcher as soon as SIGINT/SIGTERM arrives, even while the main thread is
# blocked in C and cannot run its Python handler yet; `signal_number` is the signal's number.
signal_seen = threading.Event()
signal_number = 0


def note_signal(signum: int) -> None:
    global signal_number
    signal_number = signum
    signal_seen.set()
_running: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def probe_peers() -> None:
    """Ping every peer now rather than at the next interval. A signal may mean that a peer died
    and mpirun is ending the job (its SIGKILL follows about 0.25 s later): a dead peer is then
    named at once (its socket is closed) and the server can end its streams with that reason."""
    for heartbeat in list(_running):
        heartbeat._wake.set()


def exit_now(message: str, code: int = 3) -> NoReturn:
    """Log `message` and end the process without unwinding (peers may be unreachable)."""
    try:
        log.error(message)
        for handler in log.parent.handlers if log.parent else ():
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


class Heartbeat:
    def __init__(self, group, rank: int, world_size: int, peers, interval_s: float, timeout_s: float):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.peers = peers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # stop() or probe_peers(): the leader pings now, an ABORT wait ends
        self._aborting = False
        self._departed: set[int] = set()
        # called with the message just before the heartbeat ends the process for a lost peer, so a
        # server can fail its requests first; it must return within a second or two
        self.on_peer_lost: Callable[[str], None] | None = None
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        _running.add(self)
        self._thread.start()

    def stop(self, aborting: bool = False) -> None:
        """End the heartbeat; `aborting` tells the peers this rank leaves after an error or signal."""
        self._aborting = aborting
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.interval_s + self.timeout_s + 1.0)

    def departed(self) -> set[int]:
        """Ranks that stopped their heartbeat while this one was still running."""
        return set(self._departed)

    def _run(self) -> None:
        import torch

        self._torch = torch
        try:
            if self.rank == 0:
                self._lead()
            else:
                self._follow()
        except _PeerLost as lost:
            if self._stop.is_set():
                log.debug("heartbeat during shutdown: %s", lost)
                return
            if signal_seen.is_set():
                # This rank was signalled too: either the peer left on the same signal, or it died
                # and mpirun is ending the job. Name it (a server ends its streams with it), but
                # leave as the signal says, as the rank's own unwinding would have.
                self._end(f"{self.peers[lost.rank]} {lost.reason} after this rank's signal; exiting",
                          code=128 + signal_number)
            self._end(f"{self.peers[lost.rank]} {lost.reason}; ending the job")

    def _peer_aborted(self, rank: int) -> None:
        """The peer left after an error or a signal. This rank's own unwinding may still stop the
        heartbeat; a signal of its own (often the same SIGTERM, arriving a moment later) ends it
        at once; otherwise it ends after `ABORT_GRACE_S`."""
        self._departed.add(rank)
        end = time.monotonic() + ABORT_GRACE_S
        while not self._stop.is_set():
            if signal_seen.is_set():
                exit_now(f"waiting on {self.peers[rank]}, which left after the same signal; exiting",
                         code=128 + signal_number)
            left = end - time.monotonic()
            if left <= 0:
                self._end(f"{self.peers[rank]} left the job after an error or a signal; ending the job")
            self._wake.wait(left)  # stop(), or probe_peers() from the signal watcher
            self._wake.clear()

    def _end(self, message: str, code: int = 3) -> NoReturn:
        if self.on_peer_lost is not None:
            try:
                self.on_peer_lost(message)
            except Exception as exc:  # the process ends either way
                log.debug("on_peer_lost failed: %s", exc)
        exit_now(message, code=code)

    def _send(self, seq: int, flag: int, dst: int) -> None:
        import torch.distributed as tdist

        try:
            tdist.send(self._torch.tensor([seq, flag], dtype=self._torch.int64), dst, group=self.group)
        except RuntimeError as exc:
            raise _PeerLost(dst, f"is unreachable ({short_reason(exc)})") from None

    def _recv(self, src: int, timeout_s: float) -> tuple[int, int]:
        import torch.distributed as tdist

        msg = self._torch.zeros(2, dtype=self._torch.int64)
        try:
            work = tdist.irecv(msg, src, group=self.group)
            work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            text = short_reason(exc)
            if "imed out" in text or "timeout" in text.lower():
                raise _PeerLost(src, f"sent no heartbeat for {timeout_s:g} s") from None
            raise _PeerLost(src, f"is gone (connection lost: {text})") from None
        return int(msg[0]), int(msg[1])

    def _own_flag(self) -> int:
        if not self._stop.is_set():
            return ALIVE
        return ABORT if self._aborting else STOP

    def _lead(self) -> None:
        active = set(range(1, self.world_size))
        seq = 0
        while active:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            seq += 1
            flag = self._own_flag()
            for r in sorted(active):
                self._send(seq, flag, r)
            aborted = []
            for r in sorted(active):
                _, answer = self._recv(r, self.timeout_s)
                if answer != ALIVE:
                    active.discard(r)
                    if flag == ALIVE:
                        self._departed.add(r)
                    if answer == ABORT:
                        aborted.append(r)
            if flag != ALIVE:
                return
            for r in aborted:
                self._peer_aborted(r)

    def _follow(self) -> None:
        while True:
            seq, flag = self._recv(0, self.interval_s + self.timeout_s)
            answer = self._own_flag()
            if flag != ALIVE and answer == ALIVE:
                answer = STOP  # rank 0 is leaving: this heartbeat ends either way
                self._departed.add(0)
            self._send(seq, answer, 0)
            if flag == ABORT:
                self._peer_aborted(0)
            if answer != ALIVE:
                return


class _PeerLost(Exception):
    def __init__(self, rank: int, reason: str):
        self.rank = rank
        self.reason = reason
        super().__init__(f"rank {rank} {reason}")


def short_reason(exc: BaseException) -> str:
    """The useful part of a transport error.

    "[/.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:47283: Connection reset by
    peer. This is typically caused by ..." -> "Read error [127.0.0.1]:47283: Connection reset by peer"
    """
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text.splitlines()[0])
    return text.split(". This is typically")[0].rstrip(".")[:300]
