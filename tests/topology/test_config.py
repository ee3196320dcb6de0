"""Topology YAML: the examples load into typed nodes; every bad file gets one precise message."""

import textwrap
from pathlib import Path

import pytest

from hetero_run.topology.config import load_topology, parse_topology
from hetero_run.topology.errors import ConfigError
from hetero_run.topology.schema import GiB, Interface, Node

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"

GOOD = """\
tensor_parallel_size: 2
rendezvous_port: 29600
link: {bandwidth_gbps: 200, mtu: 9000}
nodes:
  - host: spark-a
    memory_gib: 119
    gpus: 1
    interfaces:
      - {name: enp1s0f1np1, address: 192.168.100.10/24, rdma: rocep1s0f1}
      - {name: enP2p1s0f1np1, address: 192.168.101.10/24, rdma: roceP2p1s0f1}
  - host: spark-b
    memory_gib: 119
    gpus: 1
    interfaces:
      - {name: enp1s0f1np1, address: 192.168.100.11/24, rdma: rocep1s0f1}
      - {name: enP2p1s0f1np1, address: 192.168.101.11/24, rdma: roceP2p1s0f1}
"""


def error_for(tmp_path, text: str) -> ConfigError:
    path = tmp_path / "t.yaml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    return info.value


def test_dual_spark_example_mirrors_nvidia_setup():
    topo = load_topology(EXAMPLES / "dual-spark.yaml")
    assert topo.tensor_parallel_size == 2 and topo.hosts == ("spark-a", "spark-b")
    a, b = topo.nodes
    assert [str(i.address) for i in a.interfaces] == ["192.168.100.10/24", "192.168.101.10/24"]
    assert [str(i.address) for i in b.interfaces] == ["192.168.100.11/24", "192.168.101.11/24"]
    assert [i.name for i in a.interfaces] == ["enp1s0f1np1", "enP2p1s0f1np1"]
    assert a.rdma_devices == ("rocep1s0f1", "roceP2p1s0f1")
    assert topo.master_addr == "192.168.100.10" and topo.rendezvous_port == 29500
    assert topo.link.mtu == 9000 and topo.link.bandwidth_gbps == 200
    assert topo.drafter_rank == 0 and topo.fallback == "single-node"
    assert a.capacity_bytes == 119 * GiB and a.gpus == 1


def test_single_spark_example_has_one_node():
    topo = load_topology(EXAMPLES / "single-spark.yaml")
    assert topo.tensor_parallel_size == 1 and topo.hosts == ("spark-a",)


def test_defaults_and_fractional_memory():
    text = GOOD.replace("spark-b\n    memory_gib: 119\n    gpus: 1\n", "spark-b\n    memory_gib: 60.5\n")
    topo = parse_topology(text)
    assert topo.nodes[1].memory_gib == 60.5 and topo.nodes[1].gpus == 1
    assert topo.nodes[1].capacity_bytes == int(60.5 * GiB)
    assert topo.fallback == "single-node" and topo.drafter_rank == 0


def test_invalid_yaml_names_file_and_line(tmp_path):
    err = error_for(tmp_path, "tensor_parallel_size: 2\nnodes:\n  - host: [spark-a\n    memory_gib: 1\n")
    assert err.file.endswith("t.yaml") and err.line is not None
    assert "invalid YAML" in str(err) and str(err).startswith(f"{err.file}:{err.line}: ")


def test_unknown_key_with_suggestion(tmp_path):
    err = error_for(tmp_path, GOOD.replace("spark-b\n    memory_gib", "spark-b\n    memroy_gib"))
    assert str(err) == (f"{err.file}:12: nodes[1].memroy_gib: unknown key (did you mean 'memory_gib'? "
                        "expected one of: host, memory_gib, gpus, interfaces)")


def test_missing_required_field_points_at_its_mapping(tmp_path):
    err = error_for(tmp_path, GOOD.replace("  - host: spark-b\n    memory_gib: 119\n", "  - memory_gib: 119\n"))
    assert str(err) == f"{err.file}:11: nodes[1]: missing required field 'host'"


def test_duplicate_host(tmp_path):
    err = error_for(tmp_path, GOOD.replace("host: spark-b", "host: spark-a"))
    assert str(err) == f"{err.file}:11: nodes[1].host: duplicate host 'spark-a' (also nodes[0])"


def test_duplicate_key(tmp_path):
    err = error_for(tmp_path, GOOD.replace("rendezvous_port: 29600\n", "rendezvous_port: 29600\nrendezvous_port: 1\n"))
    assert str(err) == f"{err.file}:3: rendezvous_port: duplicate key 'rendezvous_port' (first on line 2)"


def test_two_interfaces_of_one_port_on_one_subnet(tmp_path):
    err = error_for(tmp_path, GOOD.replace("192.168.101.11/24", "192.168.100.12/24"))
    assert err.line == 16 and err.field == "nodes[1].interfaces[1].address"
    assert "enP2p1s0f1np1 192.168.100.12/24 is on the subnet of interfaces[0] (enp1s0f1np1 192.168.100.11/24)" \
        in str(err)


def test_cable_ends_must_share_a_subnet(tmp_path):
    err = error_for(tmp_path, GOOD.replace("192.168.100.11/24", "192.168.200.11/24"))
    assert err.line == 15 and err.field == "nodes[1].interfaces[0].address"
    assert "192.168.200.11/24 is not on the subnet of nodes[0].interfaces[0]" in str(err)


def test_wrong_type_names_value(tmp_path):
    err = error_for(tmp_path, GOOD.replace("memory_gib: 119", "memory_gib: lots", 1))
    assert str(err) == f"{err.file}:6: nodes[0].memory_gib: expected a number, got 'lots'"


@pytest.mark.parametrize("old,new,field,line,words", [
    ("192.168.100.10/24", "192.168.100.10", "nodes[0].interfaces[0].address", 9, "with its prefix length"),
    ("192.168.100.10/24", "192.168.300.10/24", "nodes[0].interfaces[0].address", 9, "192.168.300.10/24"),
    ("tensor_parallel_size: 2", "tensor_parallel_size: 3", "tensor_parallel_size", 1, "3 does not match the 2 node"),
    ("rendezvous_port: 29600", "rendezvous_port: 70000", "rendezvous_port", 2, "not a TCP port: 70000"),
    ("mtu: 9000", "mtu: 100", "link.mtu", 3, "got 100"),
    ("memory_gib: 119", "memory_gib: 0", "nodes[0].memory_gib", 6, "got 0"),
    ("name: enp1s0f1np1, address: 192.168.100.10", "name: a/b, address: 192.168.100.10",
     "nodes[0].interfaces[0].name", 9, "'a/b'"),
])
def test_bad_values(tmp_path, old, new, field, line, words):
    err = error_for(tmp_path, GOOD.replace(old, new, 1))
    assert err.field == field and err.line == line, str(err)
    assert words in str(err)


def test_policy_fields(tmp_path):
    err = error_for(tmp_path, "drafter_rank: 1\n" + GOOD)
    assert err.field == "drafter_rank" and err.line == 1 and "rank 0; got 1" in str(err)
    err = error_for(tmp_path, "fallback: maybe\n" + GOOD)
    assert err.field == "fallback" and "single-node, error, got 'maybe'" in str(err)


def test_empty_and_missing_files(tmp_path):
    assert "the file is empty" in str(error_for(tmp_path, "# nothing\n"))
    with pytest.raises(ConfigError, match="no such file"):
        load_topology(tmp_path / "absent.yaml")
    assert "expected the topology (a mapping), got a list" in str(error_for(tmp_path, "- a\n- b\n"))


def test_dataclasses_validate_themselves():
    with pytest.raises(ConfigError, match="address"):
        Interface("eth0", "10.0.0.1")
    iface = Interface("eth0", "10.0.0.1/24")
    with pytest.raises(ConfigError, match="memory_gib"):
        Node("a", (iface,), memory_gib=-1)
    node = Node("a", (iface,), memory_gib=2)
    assert node.primary is node.interfaces[0] and node.addresses == ("10.0.0.1",) and node.capacity_bytes == 2 * GiB
