"""The bounds on teardown that no thread of the process can enforce: the Deadline sentinel, and
the heartbeat's wait after a peer left. Each case runs in a child process it may end."""

import subprocess
import sys
import textwrap
import time

from support import env_for_tests

DEADLINE_CHILD = """
import sys, time
from hetero_run.launch.rendezvous import Deadline
print("ready", flush=True)
if "--close-stderr-reader" in sys.argv:
    time.sleep(0.5)  # the parent closes our stderr's reader meanwhile, as a departed mpirun does
with Deadline(float(sys.argv[1]), "guarded block took too long"):
    time.sleep(float(sys.argv[2]))
print("left the block", flush=True)
"""


def _child(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env_for_tests(), **kwargs)


def test_deadline_ends_an_overdue_block_naming_it():
    proc = _child(DEADLINE_CHILD, "1", "30")
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 20
    assert proc.returncode == -9
    assert "left the block" not in out
    assert "guarded block took too long" in err and "[rank 0]" in err


def test_deadline_leaves_a_block_that_ends_in_time_alone():
    proc = _child(DEADLINE_CHILD, "30", "0.2")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "left the block" in out and "took too long" not in err


def test_deadline_still_ends_the_process_when_nobody_reads_its_stderr():
    # With --enable-recovery mpirun returns as soon as one rank fails; a rank still tearing down
    # then writes to a pipe without a reader. Its deadline must still end it.
    proc = _child(DEADLINE_CHILD, "1", "30", "--close-stderr-reader")
    assert proc.stdout.readline().strip() == "ready"
    proc.stderr.close()
    start = time.monotonic()
    proc.wait(timeout=60)
    assert time.monotonic() - start < 20
    assert proc.returncode == -9
    assert "left the block" not in proc.stdout.read()


PEER_ABORTED_CHILD = """
import signal, sys, threading, time
from hetero_run.launch import watchdog

heartbeat = watchdog.Heartbeat(None, 1, 2, {0: "rank 0 (host h, pid 1)", 1: "rank 1 (host h, pid 2)"},
                               interval_s=1.0, timeout_s=60.0)


def signalled():  # what the signal watcher does when this rank's own SIGTERM lands
    watchdog.note_signal(signal.SIGTERM)
    watchdog.probe_peers()


def stopped():  # what stop() does before it joins the heartbeat's thread
    heartbeat._stop.set()
    heartbeat._wake.set()


watchdog._running.add(heartbeat)
if sys.argv[1] == "signal":  # just after the peer's ABORT
    threading.Timer(0.3, signalled).start()
heartbeat._peer_aborted(0)
print("returned", flush=True)
"""


def test_a_signal_after_the_peers_abort_ends_the_rank_at_once_with_its_code():
    proc = _child(PEER_ABORTED_CHILD, "signal")
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - start
    assert proc.returncode == 128 + 15, err
    assert "waiting on rank 0 (host h, pid 1), which left after the same signal; exiting" in err
    assert took < 4.0  # not the 5 s grace a rank without a signal of its own is given
    assert "returned" not in out


def test_without_a_signal_the_peers_abort_ends_the_rank_after_the_grace():
    proc = _child(PEER_ABORTED_CHILD, "none")
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert time.monotonic() - start >= 5.0
    assert "rank 0 (host h, pid 1) left the job after an error or a signal; ending the job" in err
    assert "returned" not in out


def test_a_rank_that_stops_during_the_grace_returns_quietly():
    code = PEER_ABORTED_CHILD.replace('if sys.argv[1] == "signal"', 'if True') \
        .replace("threading.Timer(0.3, signalled)", "threading.Timer(0.3, stopped)")
    proc = _child(textwrap.dedent(code), "stop")
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "returned" in out and "ending the job" not in err
    assert time.monotonic() - start < 4.0  # woken by the stop, not at the end of the grace
