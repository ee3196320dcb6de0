"""The cluster as typed, self-validating dataclasses: nodes, their QSFP interfaces, the link.

Rank i runs on `nodes[i]` (one tensor-parallel rank per node). Each node lists the netdevs of
its cabled QSFP port in the same order as every other node: `interfaces[k]` of all nodes are
the two ends of one cable path and share a subnet; `interfaces[0]` carries the process group
(gloo / NCCL sockets / MPI TCP) and the rendezvous. Errors name the field relative to the
dataclass (`address`, `nodes[1].host`); `topology.config` adds the file and line.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from hetero_run.topology.errors import ConfigError
from hetero_run.topology.yaml_source import parse_dotted

GiB = 1 << 30
FALLBACK_POLICIES = ("single-node", "error")
_IFNAME = re.compile(r"^[^\s/:]{1,15}$")  # Linux: IFNAMSIZ 16 with the NUL, no '/', no ':'
_HOST = re.compile(r"^[A-Za-z0-9_.:@\[\]-]+$")


@dataclass(frozen=True)
class Interface:
    """One netdev of the QSFP port with its address (and its RDMA device, if any)."""

    name: str  # netdev, e.g. enp1s0f1np1
    address: ipaddress.IPv4Interface  # address with prefix, e.g. 192.168.100.10/24
    rdma: str | None = None  # RDMA device on this netdev, e.g. rocep1s0f1 (ibdev2netdev)

    def __post_init__(self):
        if not isinstance(self.name, str) or not _IFNAME.match(self.name):
            raise ConfigError(
                f"not a network interface name (1-15 characters, no '/', ':' or spaces): {self.name!r}",
                field="name",
            )
        if not isinstance(self.address, ipaddress.IPv4Interface):
            object.__setattr__(self, "address", _ipv4_interface(self.address))
        if self.rdma is not None and (not isinstance(self.rdma, str) or not _IFNAME.match(self.rdma)):
            raise ConfigError(f"not an RDMA device name: {self.rdma!r}", field="rdma")

    @property
    def ip(self) -> str:
        return str(self.address.ip)


def _ipv4_interface(value) -> ipaddress.IPv4Interface:
    if not isinstance(value, str) or "/" not in value:
        raise ConfigError(f"expected an IPv4 address with its prefix length, e.g. 192.168.100.10/24, got {value!r}",
                          field="address")
    try:
        iface = ipaddress.IPv4Interface(value)
    except ValueError:
        raise ConfigError(f"not an IPv4 address with prefix length: {value!r}", field="address") from None
    if iface.network.prefixlen >= 31 or iface.ip in (iface.network.network_address, iface.network.broadcast_address):
        raise ConfigError(f"{value} is not a host address on its subnet", field="address")
    return iface


@dataclass(frozen=True)
class Node:
    """One machine: the name mpirun reaches it by, its QSFP netdevs, memory and GPUs."""

    host: str
    interfaces: tuple[Interface, ...]
    memory_gib: float  # memory the runtime may plan with on this node
    gpus: int = 1

    def __post_init__(self):
        if not isinstance(self.host, str) or not _HOST.match(self.host):
            raise ConfigError(f"not a host name or address: {self.host!r}", field="host")
        object.__setattr__(self, "interfaces", tuple(self.interfaces))
        if not self.interfaces:
            raise ConfigError("list at least one QSFP netdev", field="interfaces")
        memory = self.memory_gib
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0:
            raise ConfigError(f"expected a size in GiB > 0, got {self.memory_gib!r}", field="memory_gib")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0:
            raise ConfigError(f"expected a GPU count >= 0, got {self.gpus!r}", field="gpus")
        seen: dict[str, int] = {}
        for k, iface in enumerate(self.interfaces):
            for j, other in enumerate(self.interfaces[:k]):
                if iface.name == other.name:
                    raise ConfigError(f"{iface.name} is listed twice (also interfaces[{j}])",
                                      field=f"interfaces[{k}].name")
                if iface.address.network.overlaps(other.address.network):
                    raise ConfigError(
                        f"{iface.name} {iface.address} is on the subnet of interfaces[{j}] "
                        f"({other.name} {other.address}); the kernel would route both over one "
                        "netdev: give each netdev of the port its own subnet",
                        field=f"interfaces[{k}].address",
                    )
            if iface.rdma is not None:
                if iface.rdma in seen:
                    raise ConfigError(f"RDMA device {iface.rdma} is listed twice (also interfaces[{seen[iface.rdma]}])",
                                      field=f"interfaces[{k}].rdma")
                seen[iface.rdma] = k

    @property
    def primary(self) -> Interface:
        """The netdev the process group and the rendezvous use."""
        return self.interfaces[0]

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(i.ip for i in self.interfaces)

    @property
    def rdma_devices(self) -> tuple[str, ...]:
        return tuple(i.rdma for i in self.interfaces if i.rdma)

    @property
    def capacity_bytes(self) -> int:
        return int(self.memory_gib * GiB)


@dataclass(frozen=True)
class Link:
    """What the cable should deliver; `topology check --live` compares the interfaces with it."""

    bandwidth_gbps: float = 200.0
    mtu: int = 9000

    def __post_init__(self):
        if isinstance(self.bandwidth_gbps, bool) or not isinstance(self.bandwidth_gbps, (int, float)) \
                or not self.bandwidth_gbps > 0:
            raise ConfigError(f"expected Gb/s > 0, got {self.bandwidth_gbps!r}", field="bandwidth_gbps")
        if isinstance(self.mtu, bool) or not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65536:
            raise ConfigError(f"expected an MTU between 576 and 65536, got {self.mtu!r}", field="mtu")


@dataclass(frozen=True)
class Topology:
    nodes: tuple[Node, ...]
    tensor_parallel_size: int
    link: Link = field(default_factory=Link)
    drafter_rank: int = 0  # the drafter runs beside the driver
    fallback: str = "single-node"  # single-node: one rank runs at TP=1 with a warning | error
    rendezvous_port: int = 29500
    source: str | None = field(default=None, compare=False)  # file it was read from
    lines: Mapping[tuple, int] = field(default_factory=dict, compare=False, repr=False)  # key path -> line

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes:
            raise ConfigError("list at least one node", field="nodes")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"expected an integer >= 1, got {tp!r}", field="tensor_parallel_size")
        if tp != len(self.nodes):
            raise ConfigError(
                f"{tp} does not match the {len(self.nodes)} node(s) listed (one tensor-parallel rank per node)",
                field="tensor_parallel_size",
            )
        if self.drafter_rank != 0:
            raise ConfigError(f"the drafter runs on the driver, rank 0; got {self.drafter_rank!r}",
                              field="drafter_rank")
        if self.fallback not in FALLBACK_POLICIES:
            raise ConfigError(f"expected one of {', '.join(FALLBACK_POLICIES)}, got {self.fallback!r}",
                              field="fallback")
        port = self.rendezvous_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ConfigError(f"not a TCP port: {port!r}", field="rendezvous_port")
        self._check_nodes_agree()

    def _check_nodes_agree(self) -> None:
        hosts: dict[str, int] = {}
        addresses: dict[str, str] = {}
        first = self.nodes[0]
        for i, node in enumerate(self.nodes):
            if node.host.lower() in hosts:
                raise ConfigError(f"duplicate host {node.host!r} (also nodes[{hosts[node.host.lower()]}])",
                                  field=f"nodes[{i}].host")
            hosts[node.host.lower()] = i
            if len(node.interfaces) != len(first.interfaces):
                raise ConfigError(
                    f"{node.host} lists {len(node.interfaces)} interface(s), {first.host} lists "
                    f"{len(first.interfaces)}: list the same cabled netdevs on every node",
                    field=f"nodes[{i}].interfaces",
                )
            for k, iface in enumerate(node.interfaces):
                where = f"nodes[{i}].interfaces[{k}]"
                if iface.ip in addresses:
                    raise ConfigError(f"address {iface.ip} is also used by {addresses[iface.ip]}",
                                      field=f"{where}.address")
                addresses[iface.ip] = where
                peer = first.interfaces[k]
                if i and iface.address.network != peer.address.network:
                    raise ConfigError(
                        f"{iface.name} {iface.address} is not on the subnet of nodes[0].interfaces[{k}] "
                        f"({peer.name} {peer.address.network}): both ends of a cable path share one subnet",
                        field=f"{where}.address",
                    )

    def error(self, path: str, message: str) -> ConfigError:
        """A `ConfigError` about field `path` ("nodes[1].host") of this topology's file and line."""
        key = parse_dotted(path)
        while key and key not in self.lines:
            key = key[:-1]
        return ConfigError(message, file=self.source, field=path, line=self.lines.get(key))

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(n.host for n in self.nodes)

    @property
    def master_addr(self) -> str:
        """Rendezvous address: rank 0's primary QSFP address."""
        return self.nodes[0].primary.ip

    def node_index(self, host: str) -> int | None:
        for i, node in enumerate(self.nodes):
            if node.host.lower() == host.lower():
                return i
        return None
