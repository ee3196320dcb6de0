"""`hetero-run topology check` and `--topology` on real runs: output, exit status 2 with one
clear line for each kind of bad input, single-node fallback, -np against the topology."""

import json
import textwrap
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"
DUAL, HOSTS, SINGLE = EXAMPLES / "dual-spark.yaml", EXAMPLES / "dual-spark.hosts", EXAMPLES / "single-spark.yaml"


def flat(text: str) -> str:
    """Log text with rich's line wrapping undone."""
    return " ".join(text.split())


def one_error(out) -> str:
    assert out.returncode == 2, out.output
    assert "Traceback" not in out.output
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1, out.stderr
    return flat(out.stderr)


def test_check_prints_environment_and_command(run_cli):
    out = run_cli("topology", "check", DUAL, "--hostfile", HOSTS)
    assert out.returncode == 0, out.output
    text = out.stdout
    for expected in ("NCCL_SOCKET_IFNAME", "=enp1s0f1np1", "NCCL_IB_HCA", "=rocep1s0f1,roceP2p1s0f1",
                     "UCX_NET_DEVICES", "OMPI_MCA_btl_tcp_if_include", "GLOO_SOCKET_IFNAME",
                     "MASTER_ADDR", "192.168.100.10", "MASTER_PORT", "29500", "rank 1 (spark-b)"):
        assert expected in text, expected
    command = text[text.index("launch with:") + len("launch with:"):].strip()
    mpirun = Path(command.split()[0])
    assert mpirun.is_absolute() and mpirun.name == "mpirun" and command.split()[1:3] == ["-np", "2"]
    assert f"--hostfile {HOSTS} --map-by ppr:1:node --bind-to none --enable-recovery" in command
    assert "-x NCCL_SOCKET_IFNAME==enp1s0f1np1" in command
    assert command.rstrip().endswith(f"hetero-run doctor --topology {DUAL} --hostfile {HOSTS}")


def test_check_json_and_write_hostfile(run_cli, tmp_path):
    out = run_cli("topology", "check", DUAL, "--json", "--write-hostfile", tmp_path / "hosts",
                  "--command", "doctor --duration 30")
    assert out.returncode == 0, out.output
    report = json.loads(out.stdout)
    assert (tmp_path / "hosts").read_text().endswith("spark-a slots=1\nspark-b slots=1\n")
    argv = report["mpirun"]
    assert argv[argv.index("--hostfile") + 1] == str(tmp_path / "hosts")
    assert argv[-7:] == ["doctor", "--duration", "30", "--topology", str(DUAL), "--hostfile", str(tmp_path / "hosts")]
    assert [n["environment"]["GLOO_SOCKET_IFNAME"] for n in report["nodes"]] == ["enp1s0f1np1"] * 2
    assert report["nodes"][1]["capacity_bytes"] == 119 << 30


def test_single_node_check_says_so(run_cli):
    out = run_cli("topology", "check", SINGLE)
    assert out.returncode == 0, out.output
    assert "single node: the topology has one node (spark-a)" in flat(out.stdout)
    assert "no mpirun needed" in out.stdout and "mpirun -np" not in out.stdout


def write(tmp_path, name, text) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


BAD = {
    "invalid_yaml": ("tensor_parallel_size: 2\nnodes: [\n", ":3: invalid YAML"),
    "unknown_key": (DUAL.read_text().replace("    gpus: 1\n", "    gpu: 1\n", 1),
                    ":15: nodes[0].gpu: unknown key (did you mean 'gpus'?"),
    "missing_field": (DUAL.read_text().replace("    memory_gib: 119 ", "    # ", 1),
                      ":13: nodes[0]: missing required field 'memory_gib'"),
    "duplicate_host": (DUAL.read_text().replace("host: spark-b", "host: spark-a"),
                       ":19: nodes[1].host: duplicate host 'spark-a' (also nodes[0])"),
    "one_subnet": (DUAL.read_text().replace("192.168.101.10/24", "192.168.100.20/24"),
                   ":18: nodes[0].interfaces[1].address: enP2p1s0f1np1 192.168.100.20/24 is on the subnet of "
                   "interfaces[0] (enp1s0f1np1 192.168.100.10/24)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_topology_one_line_exit_2(run_cli, tmp_path, case):
    text, expected = BAD[case]
    path = write(tmp_path, "t.yaml", text)
    out = run_cli("topology", "check", path)
    assert f"{path}{expected}" in one_error(out)


def test_hostfile_disagreeing_with_topology(run_cli, tmp_path):
    hosts = write(tmp_path, "hosts", "# swapped\nspark-b slots=1\nspark-a slots=1\n")
    err = one_error(run_cli("topology", "check", DUAL, "--hostfile", hosts))
    assert f"{hosts}:2: spark-b: is nodes[1] in {DUAL} but line 1 of the hosts" in err
    # the same check runs on every rank of a launched command
    err = one_error(run_cli("doctor", "--topology", DUAL, "--hostfile", hosts))
    assert f"{hosts}:2: spark-b: is nodes[1]" in err
    err = one_error(run_cli("doctor", "--hostfile", hosts))
    assert "--hostfile: is checked against a topology: give --topology too" in err


@pytest.mark.mpi
def test_np_not_matching_tp_exits_2_on_every_rank(run_cli):
    out = run_cli("doctor", "--topology", DUAL, np=3, timeout=120)
    assert out.returncode == 2, out.output
    assert "Traceback" not in out.output
    text = flat(out.stderr)
    message = (f"{DUAL}:5: tensor_parallel_size: the job has 3 ranks (mpirun -np 3) but the topology's "
               "tensor-parallel size is 2 (spark-a, spark-b): launch with mpirun -np 2")
    # every rank checks on its own; mpirun ends the others once the first exits, so some may
    # not get to print, and none prints another error
    assert any(f"[rank {rank}] {message}" in text for rank in range(3)), text
    assert text.count("ERROR") == text.count(message) >= 1, text


def test_one_rank_falls_back_to_tp1_loudly(run_cli):
    out = run_cli("doctor", "--topology", DUAL, "--json", "--iters", "1")
    assert out.returncode == 0, out.output
    assert json.loads(out.stdout)["world_size"] == 1
    assert ("WARNING [rank 0] SINGLE-NODE RUN: launched with one rank, but the topology asks for TP=2 across "
            "spark-a, spark-b: running at TP=1 on this node alone (single-node fallback)") in flat(out.stderr)


def test_one_node_topology_runs_at_tp1_loudly(run_cli):
    out = run_cli("doctor", "--topology", SINGLE, "--json", "--iters", "1")
    assert out.returncode == 0, out.output
    assert "SINGLE-NODE RUN: the topology has one node (spark-a): running at TP=1" in flat(out.stderr)


@pytest.mark.mpi
def test_mpirun_with_one_rank_falls_back_too(run_cli):
    out = run_cli("doctor", "--topology", DUAL, "--json", "--iters", "1", np=1, timeout=120)
    assert out.returncode == 0, out.output
    assert json.loads(out.stdout)["world_size"] == 1
    assert "SINGLE-NODE RUN: launched with one rank" in flat(out.stderr)


def test_fallback_policy_error_refuses_one_rank(run_cli, tmp_path):
    path = write(tmp_path, "strict.yaml", DUAL.read_text().replace("fallback: single-node", "fallback: error"))
    err = one_error(run_cli("doctor", "--topology", path))
    assert f"{path}:8: fallback: launched with one rank, the topology asks for TP=2" in err


LOOPBACK_PAIR = """\
# Both "nodes" on this host's loopback; 127.0.0.2 is not an address of lo, so rank 1 must refuse.
tensor_parallel_size: 2
rendezvous_port: {port}
link: {{mtu: 65536}}
nodes:
  - {{host: node-a, memory_gib: 1, gpus: 0, interfaces: [{{name: lo, address: 127.0.0.1/8}}]}}
  - {{host: node-b, memory_gib: 1, gpus: 0, interfaces: [{{name: lo, address: 127.0.0.2/8}}]}}
"""


@pytest.mark.mpi
@pytest.mark.parametrize("mpirun_flags", [(), ("--enable-recovery",)], ids=["default", "enable-recovery"])
def test_address_not_on_its_interface_stops_the_rank(run_cli, tmp_path, mpirun_flags):
    import uuid

    import psutil

    from hetero_run.launch.rendezvous import free_port

    path = write(tmp_path, "lo.yaml", LOOPBACK_PAIR.format(port=free_port("127.0.0.1")))
    tag = uuid.uuid4().hex
    out = run_cli("doctor", "--topology", path, "--peer-timeout", "10", "--log-dir", tmp_path / "logs", np=2,
                  timeout=120, mpirun_flags=mpirun_flags, env={"HETERO_RUN_TEST_TAG": tag})
    assert out.returncode == 2, out.output
    assert "Traceback" not in out.output
    assert (f"[rank 1] {path}:7: nodes[1].interfaces[0].address: node node-b (rank 1): 127.0.0.2/8 is not on lo "
            "(it has 127.0.0.1/8); not starting on another interface") in flat(out.stderr), out.stderr

    # mpirun returns at once; rank 0 must end too, and never carry on as a one-rank job.
    def ours():
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get("HETERO_RUN_TEST_TAG") == tag:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    end = time.monotonic() + 30
    while ours() and time.monotonic() < end:
        time.sleep(0.2)
    assert not ours()
    assert "process group up" not in (tmp_path / "logs" / "rank0.log").read_text()

def test_live_without_mpirun_checks_this_host(run_cli, tmp_path):
    from hetero_run.launch.rendezvous import free_port

    path = write(tmp_path, "lo.yaml", LOOPBACK_PAIR.format(port=free_port("127.0.0.1")))
    out = run_cli("topology", "check", path, "--live", "--json")
    assert out.returncode == 0, out.output
    live = {c["check"]: c for c in json.loads(out.stdout)["live"]}
    assert live["lo address"]["status"] == "ok" and live["lo mtu"]["detail"] == "65536"
    assert {c["node"] for c in live.values()} == {"node-a"}  # this host is node-a by its address

    wrong_mtu = write(tmp_path, "mtu.yaml", path.read_text().replace("mtu: 65536", "mtu: 9000"))
    err = one_error(run_cli("topology", "check", wrong_mtu, "--live"))
    assert (f"{wrong_mtu}:4: link.mtu: node node-a: lo mtu: MTU 65536, the topology's link.mtu is 9000 "
            "(ip link set lo mtu 9000, on both nodes)") in err
