"""Real `mpirun -np 2` jobs over gloo: bootstrap, doctor, clean exits, peer failures, signals."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from support import env_for_tests, hetero_run_argv, mpirun_argv, rank_pids

pytestmark = pytest.mark.mpi


def test_doctor_two_ranks_json(run_cli):
    out = run_cli("doctor", "--json", "--iters", "10", np=2)
    assert out.returncode == 0, out.output
    report = json.loads(out.stdout)
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert len({r["pid"] for r in report["ranks"]}) == 2
    link = report["link"]
    for name in ("broadcast_latency", "all_reduce_latency", "broadcast_bandwidth", "all_reduce_bandwidth"):
        assert link[name]["median_us"] > 0 and link[name]["bus_gbps"] > 0, name
    assert link["all_reduce_latency"]["bytes"] == 8192
    assert link["all_reduce_bandwidth"]["bytes"] == 64 << 20


def test_doctor_table_on_rank_0_only(run_cli):
    out = run_cli("doctor", "--iters", "5", "--bandwidth-bytes", "1048576", np=2)
    assert out.returncode == 0, out.output
    assert out.stdout.count("hetero-run doctor: 2 rank(s)") == 1
    assert "all reduce latency" in out.stdout
    assert "[rank 1]" not in out.stderr  # rank 1 is quiet unless --verbose


def test_verbose_shows_every_rank_and_log_dir_has_one_file_per_rank(run_cli, tmp_path):
    out = run_cli("doctor", "--iters", "3", "--bandwidth-bytes", "65536", "-v", "--log-dir", tmp_path, np=2)
    assert out.returncode == 0, out.output
    assert "[rank 0]" in out.stderr and "[rank 1]" in out.stderr
    for rank in (0, 1):
        text = (tmp_path / f"rank{rank}.log").read_text()
        assert f"[rank {rank}]" in text and "shut down cleanly" in text


def test_twenty_consecutive_runs_exit_cleanly(run_cli):
    for i in range(20):
        out = run_cli("doctor", "--json", "--iters", "3", "--bandwidth-bytes", "65536", np=2, timeout=120)
        assert out.returncode == 0, f"run {i}: {out.output}"
        assert "abort" not in out.output.lower() and "terminate called" not in out.output, out.output


def _wait_for_ranks(proc, log_dir, timeout=120.0):
    """Until both ranks have their process group (start-up takes seconds on a loaded machine)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        logs = [log_dir / f"rank{rank}.log" for rank in (0, 1)]
        if all(p.exists() and "process group up" in p.read_text() for p in logs):
            time.sleep(1.0)  # into the measurement loop
            return
        if proc.poll() is not None:
            raise AssertionError(f"job ended early: {proc.communicate()}")
        time.sleep(0.2)
    raise AssertionError("ranks did not start")


@pytest.mark.parametrize("mpirun_flags", [(), ("--enable-recovery",)], ids=["default", "enable-recovery"])
def test_killing_rank_1_ends_rank_0_naming_it(popen_cli, mpirun_flags, tmp_path):
    proc = popen_cli("doctor", "--duration", "120", "--bandwidth-bytes", "1048576", "--log-dir", tmp_path,
                     mpirun_flags=mpirun_flags)
    _wait_for_ranks(proc, tmp_path)
    (victim,) = rank_pids(proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    stdout, stderr = proc.communicate(timeout=90)
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    # Named by whichever notices first: the main thread's collective or the heartbeat (when
    # mpirun's SIGTERM, sent because rank 1 died, wakes it first).
    assert re.search(rf"rank 1 \(host {re.escape(os.uname().nodename)}, pid {victim}\) "
                     r"(stopped responding|is gone|is unreachable)", stderr), stderr
    assert "Traceback" not in stderr


def test_peer_that_never_arrives_ends_the_job(tmp_path):
    # Rank 1 never starts hetero-run; rank 0 must give up after --peer-timeout and say why.
    script = tmp_path / "rank.sh"
    script.write_text(
        '#!/bin/sh\nif [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then exec sleep 600; fi\n'
        f'exec {" ".join(hetero_run_argv())} doctor --peer-timeout 5\n'
    )
    script.chmod(0o755)
    start = time.monotonic()
    proc = subprocess.run(mpirun_argv(2) + [str(script)], capture_output=True, text=True, timeout=120,
                          env=env_for_tests())
    assert time.monotonic() - start < 60
    assert proc.returncode != 0
    assert "rank 1 never started" in proc.stderr, proc.stderr
    assert "within 5 s" in proc.stderr


def test_sigterm_to_every_rank_ends_the_job_quickly(popen_cli, tmp_path):
    proc = popen_cli("doctor", "--duration", "120", "--bandwidth-bytes", "1048576", "--log-dir", tmp_path,
                     mpirun_flags=("--enable-recovery",))
    _wait_for_ranks(proc, tmp_path)
    ranks = rank_pids(proc.pid, 0) + rank_pids(proc.pid, 1)
    start = time.monotonic()
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - start < 15
    assert proc.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in stderr and "terminate called" not in stderr
    _wait_gone(ranks)  # mpirun may return while a rank still writes its last lines
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in (0, 1)]
    for text in logs:
        assert "received SIGTERM; shutting down" in text, text
    # A rank in Python when the signal lands unwinds through teardown. A rank blocked in a
    # collective cannot (gloo cannot interrupt it); the heartbeat ends it once its peer has left.
    # mpirun may kill a rank still tearing down once its peer has exited on the signal, so at
    # least one rank (not necessarily both) gets to log the end of its teardown. A rank whose
    # heartbeat finds its peer already gone names it and leaves on the signal too.
    assert any("process group destroyed" in text or "which left after the same signal" in text
               or "after this rank's signal; exiting" in text for text in logs), logs
    # Some rank ends on a line that says how: teardown complete, its MPI_Finalize deadline (the
    # Deadline sentinel reports on stderr, not in the log files), or its heartbeat naming the peer
    # that left first. That last one alone happens: the other rank, in MPI_Finalize by then, is
    # ended there by the MPI runtime once its peer is gone (seen under load), within the bound above.
    ended = ("shut down cleanly", "which left after the same signal", "after this rank's signal; exiting")
    assert any(line in text for text in logs for line in ended) or "MPI shutdown did not complete" in stderr, logs


def test_sigint_to_mpirun_stops_every_rank(popen_cli, tmp_path):
    proc = popen_cli("doctor", "--duration", "120", "--bandwidth-bytes", "1048576", "--log-dir", tmp_path)
    _wait_for_ranks(proc, tmp_path)
    ranks = rank_pids(proc.pid, 0) + rank_pids(proc.pid, 1)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    _wait_gone(ranks)
    # mpirun forwards the signal; a rank it has not reached yet leaves through the same
    # teardown once its peer is gone. Every rank leaves cleanly, at least one on the signal.
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert all("shutting down" in text or "process group destroyed" in text for text in logs), logs
    assert any("shutting down" in text for text in logs), logs


def _wait_gone(pids, timeout=10.0) -> None:
    end = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_nccl_on_ranks_without_cuda_is_one_error_on_every_rank(run_cli):
    start = time.monotonic()
    out = run_cli("doctor", "--backend", "nccl", np=2, timeout=120)
    assert time.monotonic() - start < 60
    assert out.returncode == 2, out.output
    assert "Traceback" not in out.output
    assert re.search(r"backend nccl: needs a CUDA device on every rank; rank 0 \(host \S+, pid \d+\) has none",
                     out.stderr), out.stderr
