"""The derived per-node environment and the mpirun command line."""

from pathlib import Path

from hetero_run.topology.config import load_topology, parse_topology
from hetero_run.topology.environment import conflicts, node_environment, shared_environment
from hetero_run.topology.launch_command import format_command, mpirun_command

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"

MIXED = """\
tensor_parallel_size: 2
rendezvous_port: 29611
nodes:
  - host: a
    memory_gib: 8
    gpus: 0
    interfaces: [{name: eth1, address: 10.9.0.1/24}]
  - host: b
    memory_gib: 8
    gpus: 0
    interfaces: [{name: ens5, address: 10.9.0.2/24}]
"""


def test_dual_spark_environment():
    topo = load_topology(EXAMPLES / "dual-spark.yaml")
    for rank in (0, 1):
        assert node_environment(topo, rank) == {
            "NCCL_SOCKET_IFNAME": "=enp1s0f1np1",
            "NCCL_IB_HCA": "=rocep1s0f1,roceP2p1s0f1",
            "UCX_NET_DEVICES": "enp1s0f1np1",
            "OMPI_MCA_btl_tcp_if_include": "enp1s0f1np1",
            "GLOO_SOCKET_IFNAME": "enp1s0f1np1",
            "MASTER_ADDR": "192.168.100.10",
            "MASTER_PORT": "29500",
        }


def test_per_node_interfaces_and_no_rdma():
    topo = parse_topology(MIXED)
    a, b = node_environment(topo, 0), node_environment(topo, 1)
    assert a["GLOO_SOCKET_IFNAME"] == "eth1" and b["GLOO_SOCKET_IFNAME"] == "ens5"
    assert a["NCCL_IB_DISABLE"] == b["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in a
    assert a["MASTER_ADDR"] == b["MASTER_ADDR"] == "10.9.0.1"
    assert shared_environment(topo) == {"NCCL_IB_DISABLE": "1", "MASTER_ADDR": "10.9.0.1", "MASTER_PORT": "29611"}


def test_conflicts():
    assert conflicts({"GLOO_SOCKET_IFNAME": "eth0", "X": "1"}, {"GLOO_SOCKET_IFNAME": "eth1", "Y": "2"}) == [
        ("GLOO_SOCKET_IFNAME", "eth0", "eth1")
    ]
    assert conflicts({"GLOO_SOCKET_IFNAME": "eth1"}, {"GLOO_SOCKET_IFNAME": "eth1"}) == []


def test_mpirun_command_for_dual_spark(tmp_path):
    topo = load_topology(EXAMPLES / "dual-spark.yaml")
    bin_dir = tmp_path / ".venv" / "bin"
    argv = mpirun_command(topo, EXAMPLES / "dual-spark.yaml", ["doctor", "--duration", "5"],
                          EXAMPLES / "dual-spark.hosts", bin_dir=bin_dir)
    hosts, yaml = str(EXAMPLES / "dual-spark.hosts"), str(EXAMPLES / "dual-spark.yaml")
    assert argv[:5] == [argv[0], "-np", "2", "--hostfile", hosts]
    assert argv[5:10] == ["--map-by", "ppr:1:node", "--bind-to", "none", "--enable-recovery"]
    xs = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert xs == ["NCCL_SOCKET_IFNAME==enp1s0f1np1", "NCCL_IB_HCA==rocep1s0f1,roceP2p1s0f1",
                  "UCX_NET_DEVICES=enp1s0f1np1", "OMPI_MCA_btl_tcp_if_include=enp1s0f1np1",
                  "GLOO_SOCKET_IFNAME=enp1s0f1np1", "MASTER_ADDR=192.168.100.10", "MASTER_PORT=29500"]
    tail = argv[argv.index(str(bin_dir / "hetero-run")):]
    assert tail == [str(bin_dir / "hetero-run"), "doctor", "--duration", "5", "--topology", yaml, "--hostfile", hosts]
    text = format_command(argv)
    assert text.splitlines()[0].endswith("--enable-recovery \\")
    assert text.splitlines()[-1].strip().startswith(str(bin_dir / "hetero-run"))
    assert " ".join(text.replace("\\\n", " ").split()) == " ".join(argv)


def test_mpirun_without_hostfile_uses_host_list_and_per_node_names_stay_off_the_line():
    topo = parse_topology(MIXED)
    argv = mpirun_command(topo, "t.yaml", ["doctor"])
    assert argv[argv.index("--host") + 1] == "a:1,b:1"
    assert not any("GLOO_SOCKET_IFNAME" in a for a in argv)  # differs per node: each rank applies its own
    assert Path(argv[argv.index("--topology") + 1]).is_absolute()


def test_single_node_needs_no_mpirun():
    topo = load_topology(EXAMPLES / "single-spark.yaml")
    argv = mpirun_command(topo, EXAMPLES / "single-spark.yaml", ["doctor"])
    assert Path(argv[0]).name == "hetero-run" and "mpirun" not in " ".join(argv)
