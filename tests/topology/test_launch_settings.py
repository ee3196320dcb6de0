"""launch_settings: the topology turned into this rank's LaunchSettings, before anything starts."""

import argparse
import socket
import textwrap

import pytest

from hetero_run.launch.settings import launch_settings, topology_environment
from hetero_run.topology.errors import ConfigError

# Rank 0 is this host's loopback, so its node checks pass here without root.
PAIR = """\
tensor_parallel_size: 2
rendezvous_port: {port}
link: {{mtu: 65536}}
nodes:
  - {{host: node-a, memory_gib: 1, gpus: 0, interfaces: [{{name: lo, address: 127.0.0.1/8}}]}}
  - {{host: node-b, memory_gib: 1, gpus: 0, interfaces: [{{name: lo, address: 127.0.0.2/8}}]}}
"""


@pytest.fixture
def pair(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "pair.yaml"
    path.write_text(textwrap.dedent(PAIR.format(port=port)))
    return path, port


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_SIZE", "GLOO_SOCKET_IFNAME",
                 "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def args(**kw):
    return argparse.Namespace(**{"peer_timeout": 30.0, "backend": "gloo", "topology": None, "hostfile": None, **kw})


def test_without_topology_nothing_changes():
    s = launch_settings(args())
    assert s.env == {} and s.master_addr is None and s.peer_timeout_s == 30.0 and s.backend == "gloo"


def test_rank_0_gets_its_nodes_environment(pair):
    path, port = pair
    env = topology_environment(path, None, rank=0, world_size=2)
    assert env == {"NCCL_SOCKET_IFNAME": "=lo", "NCCL_IB_DISABLE": "1", "UCX_NET_DEVICES": "lo",
                   "OMPI_MCA_btl_tcp_if_include": "lo", "GLOO_SOCKET_IFNAME": "lo",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_launch_settings_under_mpirun(pair, monkeypatch):
    path, port = pair
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    s = launch_settings(args(topology=str(path)))
    assert s.master_addr == "127.0.0.1" and s.master_port == port and s.env["GLOO_SOCKET_IFNAME"] == "lo"


def test_rank_1_refuses_an_address_its_interface_lacks(pair):
    with pytest.raises(ConfigError, match=r"node node-b \(rank 1\): 127.0.0.2/8 is not on lo"):
        topology_environment(pair[0], None, rank=1, world_size=2)


def test_conflicting_environment_is_an_error(pair, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    with pytest.raises(ConfigError) as info:
        topology_environment(pair[0], None, rank=0, world_size=2)
    assert info.value.field == "GLOO_SOCKET_IFNAME"
    assert "GLOO_SOCKET_IFNAME=eth0 is set in the environment, but the topology gives lo for node node-a" in str(
        info.value)


def test_nvidia_style_plain_interface_name_is_not_a_conflict(pair, monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")  # the guide's form; the topology says "=lo"
    assert topology_environment(pair[0], None, rank=0, world_size=2)["NCCL_SOCKET_IFNAME"] == "=lo"


def test_rendezvous_port_in_use_is_named(pair):
    path, port = pair
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", port))
        busy.listen(1)
        with pytest.raises(ConfigError) as info:
            topology_environment(path, None, rank=0, world_size=2)
    assert info.value.field == "rendezvous_port" and info.value.line == 2
    assert f"port {port} on node-a is not free" in str(info.value)


def test_single_rank_binds_nothing(pair):
    assert topology_environment(pair[0], None, rank=0, world_size=1) == {}
