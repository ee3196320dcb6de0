"""A host against its node: interfaces, addresses, MTU, RDMA devices, host name."""

import ipaddress
from pathlib import Path

import pytest

from hetero_run.topology.checks import identity_problem, node_checks, require_node_ready
from hetero_run.topology.config import load_topology, parse_topology
from hetero_run.topology.errors import ConfigError
from hetero_run.topology.interfaces import InterfaceState, interface_states, parse_route, rdma_netdevs

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


def state(name, address, up=True, running=True, mtu=9000, speed=200000):
    addrs = (ipaddress.IPv4Interface(address),) if address else ()
    return InterfaceState(name, True, up, running, mtu, speed, addrs)


def healthy(node_index: int) -> dict[str, InterfaceState]:
    last = 10 + node_index
    return {
        "enp1s0f1np1": state("enp1s0f1np1", f"192.168.100.{last}/24"),
        "enP2p1s0f1np1": state("enP2p1s0f1np1", f"192.168.101.{last}/24"),
        "eth0": state("eth0", "10.0.0.5/24", mtu=1500, speed=1000),
    }


def fake_sysfs(root: Path, pairs: dict[str, str]) -> Path:
    for dev, netdev in pairs.items():
        (root / "class" / "infiniband" / dev / "device" / "net" / netdev).mkdir(parents=True)
    return root


@pytest.fixture
def dual():
    return load_topology(EXAMPLES / "dual-spark.yaml")


def by_name(checks):
    return {c.name: c for c in checks}


def test_healthy_node_passes_every_check(dual, tmp_path):
    sysfs = fake_sysfs(tmp_path, {"rocep1s0f1": "enp1s0f1np1", "roceP2p1s0f1": "enP2p1s0f1np1"})
    checks = node_checks(dual, 1, healthy(1), sysfs=sysfs, memory_bytes=128 << 30, gpu_count=1)
    assert [c.status for c in checks] == ["ok"] * len(checks)
    names = by_name(checks)
    assert names["enP2p1s0f1np1 rdma"].detail == "roceP2p1s0f1 on enP2p1s0f1np1"
    assert names["enp1s0f1np1 speed"].detail == "200 Gb/s"
    require_node_ready(dual, 1, healthy(1), hostname="spark-b", sysfs=sysfs)


def test_each_problem_is_reported(dual, tmp_path):
    states = healthy(0)
    states["enp1s0f1np1"] = state("enp1s0f1np1", "192.168.100.12/24", mtu=1500, speed=100000)
    states["enP2p1s0f1np1"] = state("enP2p1s0f1np1", "192.168.101.10/24", running=False)
    sysfs = fake_sysfs(tmp_path, {"rocep1s0f1": "enP2p1s0f1np1"})
    checks = by_name(node_checks(dual, 0, states, sysfs=sysfs, memory_bytes=64 << 30, gpu_count=0))
    assert checks["enp1s0f1np1 address"].detail == "192.168.100.10/24 is not on enp1s0f1np1 (it has 192.168.100.12/24)"
    assert checks["enp1s0f1np1 mtu"].status == "fail" and "MTU 1500, the topology's link.mtu is 9000" in \
        checks["enp1s0f1np1 mtu"].detail
    assert checks["enp1s0f1np1 speed"].status == "warn"
    assert checks["enP2p1s0f1np1 up"].detail.startswith("enP2p1s0f1np1 is up but has no carrier")
    assert checks["enp1s0f1np1 rdma"].detail == "RDMA device rocep1s0f1 is on enP2p1s0f1np1, not enp1s0f1np1"
    assert checks["enP2p1s0f1np1 rdma"].detail.startswith("no RDMA device roceP2p1s0f1")
    assert checks["memory"].status == "warn" and checks["gpus"].status == "fail"


def test_missing_and_down_interfaces(dual):
    states = healthy(0)
    del states["enP2p1s0f1np1"]
    states["enp1s0f1np1"] = state("enp1s0f1np1", "192.168.100.10/24", up=False, running=False)
    checks = by_name(node_checks(dual, 0, states))
    assert checks["enP2p1s0f1np1 exists"].detail == \
        "no interface enP2p1s0f1np1 on this host (it has: enp1s0f1np1, eth0)"
    assert checks["enp1s0f1np1 up"].detail == "enp1s0f1np1 is down (ip link set enp1s0f1np1 up)"


def test_ready_node_raises_nothing_but_warns_about_mtu(dual, tmp_path):
    states = healthy(1)
    states["enP2p1s0f1np1"] = state("enP2p1s0f1np1", "192.168.101.11/24", mtu=1500)
    warnings = []
    sysfs = fake_sysfs(tmp_path, {"rocep1s0f1": "enp1s0f1np1", "roceP2p1s0f1": "enP2p1s0f1np1"})
    require_node_ready(dual, 1, states, hostname="spark-b.lan", warn=warnings.append, sysfs=sysfs)
    assert warnings == ["node spark-b (rank 1): MTU 1500, the topology's link.mtu is 9000 "
                        "(ip link set enP2p1s0f1np1 mtu 9000, on both nodes)"]


def test_address_not_on_its_interface_is_fatal(dual):
    states = healthy(1)
    states["enp1s0f1np1"] = state("enp1s0f1np1", "192.168.100.99/24")
    with pytest.raises(ConfigError) as info:
        require_node_ready(dual, 1, states, hostname="spark-b")
    err = info.value
    assert err.field == "nodes[1].interfaces[0].address" and err.line == 23 and err.file.endswith("dual-spark.yaml")
    assert str(err).endswith("node spark-b (rank 1): 192.168.100.11/24 is not on enp1s0f1np1 "
                             "(it has 192.168.100.99/24); not starting on another interface")


def test_rdma_device_missing_is_fatal(dual, tmp_path):
    sysfs = fake_sysfs(tmp_path, {"rocep1s0f1": "enp1s0f1np1"})
    with pytest.raises(ConfigError) as info:
        require_node_ready(dual, 0, healthy(0), hostname="spark-a", sysfs=sysfs)
    assert info.value.field == "nodes[0].interfaces[1].rdma"
    assert "no RDMA device roceP2p1s0f1" in str(info.value)


def test_missing_interface_is_fatal(dual):
    with pytest.raises(ConfigError, match=r"node spark-a \(rank 0\): no interface enp1s0f1np1 on this host"):
        require_node_ready(dual, 0, {"eth0": state("eth0", "10.0.0.5/24")}, hostname="spark-a")


def test_rank_on_the_wrong_host(dual):
    assert identity_problem(dual, 0, "spark-a") is None
    assert identity_problem(dual, 0, "spark-a.example.org") is None
    assert identity_problem(dual, 0, "gpu-box-7") is None  # an ssh alias: the addresses decide
    by_address = parse_topology((EXAMPLES / "dual-spark.yaml").read_text().replace("host: spark-b", "host: 10.1.2.3"))
    assert identity_problem(by_address, 0, "10") is None  # an address is not a host name
    problem = identity_problem(dual, 0, "spark-b")
    assert problem.startswith("rank 0 runs on spark-b, which is nodes[1] in ")
    with pytest.raises(ConfigError, match="hostfile must list the hosts in the topology's node order") as info:
        require_node_ready(dual, 0, healthy(0), hostname="spark-b")
    assert info.value.field == "nodes[0].host" and info.value.line == 13


def test_parse_route():
    r = parse_route("198.18.0.2 dev q1a src 198.18.0.1 uid 0 \\    cache \n")
    assert (r.dev, r.src) == ("q1a", "198.18.0.1")
    r = parse_route("198.18.0.2 from 198.18.0.1 dev q1a uid 0 \\    cache")
    assert (r.dev, r.src) == ("q1a", None)
    assert parse_route("RTNETLINK answers: Network is unreachable") is None


def test_real_interfaces_of_this_host():
    states = interface_states()
    lo = states["lo"]
    assert lo.exists and lo.admin_up and lo.carries(ipaddress.IPv4Interface("127.0.0.1/8"))
    assert rdma_netdevs("no-such-rdma-device") is None
