"""A real two-host TP=2 job: two network namespaces, a veth pair as the QSFP cable, mpirun with
a hostfile reaching the second host through an `ip netns exec` agent. The job is launched with
the exact command `hetero-run topology check` prints."""

import json
import re
import subprocess
import time

import pytest
from support import env_for_tests, hetero_run_argv

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

MiB = 1 << 20


def printed_command(pair, command: str, topology=None) -> list[str]:
    """The mpirun argv `topology check` prints for `command` on the pair's topology."""
    out = subprocess.run(
        hetero_run_argv() + ["topology", "check", str(topology or pair.topology), "--hostfile", str(pair.hostfile),
                             "--json", "--command", command],
        capture_output=True, text=True, timeout=60, env=env_for_tests(),
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["mpirun"]


def test_live_check_passes_on_both_hosts(two_hosts):
    argv = printed_command(two_hosts, "topology check --live --json")
    # `topology check` itself takes the topology as --topology here, like any other command.
    out = two_hosts.run(argv)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True
    checks = {(c["node"], c["check"]): c for c in report["live"]}
    a, b = two_hosts.hosts
    qa, qb = two_hosts.qsfp
    for host, dev in ((a, qa), (b, qb)):
        for what in ("exists", "up", "address", "mtu"):
            assert checks[(host, f"{dev} {what}")]["status"] == "ok", checks[(host, f"{dev} {what}")]
    assert checks[(a, f"{qa} -> {b} 198.18.0.2 route")]["detail"] == f"via {qa}"
    assert checks[(b, f"{qb} -> {a} 198.18.0.1 route")]["detail"] == f"via {qb}"
    assert checks[(a, f"{qa} <- {b} 198.18.0.2")]["detail"] == "arrived from 198.18.0.2"
    assert checks[(b, f"{qb} <- {a} 198.18.0.1")]["detail"] == "arrived from 198.18.0.1"


def test_doctor_tp2_spans_both_hosts_over_the_qsfp_veth(two_hosts):
    argv = printed_command(two_hosts, f"doctor --json --iters 5 --bandwidth-bytes {4 * MiB}")
    qsfp_before = two_hosts.bytes(0, two_hosts.qsfp[0])
    lan_before = two_hosts.bytes(0, two_hosts.lan[0])
    out = two_hosts.run(argv)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert [r["host"] for r in report["ranks"]] == list(two_hosts.hosts)
    qsfp = two_hosts.bytes(0, two_hosts.qsfp[0]) - qsfp_before
    lan = two_hosts.bytes(0, two_hosts.lan[0]) - lan_before
    # 4 MiB broadcasts and all-reduces (at least 4 of each, warm-up included) crossed the cable;
    # the management LAN carried only mpirun's own control messages.
    assert qsfp > 24 * MiB, (qsfp, lan)
    assert lan < 2 * MiB, (qsfp, lan)


def test_address_not_on_its_interface_stops_the_rank(two_hosts, tmp_path):
    wrong = two_hosts.write_topology(tmp_path / "wrong.yaml", ("198.18.0.1/24", "198.18.0.3/24"))
    argv = printed_command(two_hosts, "doctor --peer-timeout 10", topology=wrong)
    start = time.monotonic()
    out = two_hosts.run(argv, timeout=90)
    assert time.monotonic() - start < 60
    assert out.returncode != 0
    b, qb = two_hosts.hosts[1], two_hosts.qsfp[1]
    assert (f"nodes[1].interfaces[0].address: node {b} (rank 1): 198.18.0.3/24 is not on {qb} "
            f"(it has 198.18.0.2/24); not starting on another interface") in _flat(out.stderr), out.stderr
    assert "Traceback" not in out.stderr
    # rank 0 ends too (mpirun left it behind; it must not carry on as a one-rank job)
    _wait_for(lambda: not two_hosts.pids(0) and not two_hosts.pids(1), 30)


def test_link_down_mid_job_ends_both_ranks_naming_the_peer(two_hosts, tmp_path):
    logs = tmp_path / "logs"
    argv = printed_command(two_hosts, f"doctor --duration 60 --peer-timeout 10 --iters 5 "
                                      f"--bandwidth-bytes {MiB} --log-dir {logs}")
    proc = two_hosts.popen(argv)
    try:
        _wait_for(lambda: all("process group up" in _read(logs / f"rank{r}.log") for r in (0, 1)), 90, proc)
        time.sleep(2)  # mid-measurement
        two_hosts.set_link(0, up=False)
        down = time.monotonic()
        stdout, stderr = proc.communicate(timeout=120)
        elapsed = time.monotonic() - down
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        two_hosts.set_link(0, up=True)
    assert elapsed < 60, elapsed
    assert proc.returncode != 0
    a, b = two_hosts.hosts
    peer_lost = r"(sent no heartbeat for \d+ s|is unreachable|is gone|stopped responding)"
    # Both ranks watch each other; whichever notices first ends the job, and mpirun may kill
    # the other before it reports. At least one names its peer, each in the right words.
    said = _flat(stderr + _read(logs / "rank0.log") + _read(logs / "rank1.log"))
    named = [re.search(rf"\[rank 0\].{{0,80}}rank 1 \(host {b}, pid \d+\) {peer_lost}", said),
             re.search(rf"\[rank 1\].{{0,80}}rank 0 \(host {a}, pid \d+\) {peer_lost}", said)]
    assert any(named), stderr
    assert "Traceback" not in stderr
    # Nothing is left running in either host.
    _wait_for(lambda: not two_hosts.pids(0) and not two_hosts.pids(1), 10)


def _flat(text: str) -> str:
    """Log text with rich's line wrapping undone."""
    return " ".join(text.split())


def _read(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _wait_for(condition, timeout: float, proc=None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job ended early: {proc.communicate()}")
        time.sleep(0.2)
    raise AssertionError("timed out waiting")
