"""Does this host match its node in the topology? Interfaces, addresses, MTU, RDMA devices.

`node_checks` lists every finding (for `topology check --live`); `require_node_ready` is what
every rank runs before its process group starts: a missing or down interface, or an address
that is not where the topology says, ends the rank with one message naming the node, the
interface and the address. A rank never falls back to another interface.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetero_run.topology.errors import ConfigError
from hetero_run.topology.interfaces import InterfaceState, interface_states, rdma_netdevs
from hetero_run.topology.schema import GiB, Topology

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    node: str  # host of the node checked
    name: str  # what was checked: "enp1s0f1np1 address", "route to spark-b", ...
    status: str  # ok | warn | fail
    detail: str
    field: str | None = None  # topology field it concerns, e.g. nodes[1].interfaces[0].address

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def to_dict(self) -> dict:
        return {"node": self.node, "check": self.name, "status": self.status, "detail": self.detail,
                "field": self.field}


def identity_problem(topology: Topology, index: int, hostname: str | None = None) -> str | None:
    """Why this host cannot be `nodes[index]` by its name (None when the name does not object).

    A host name that matches no node is allowed (the hostfile may use an ssh alias or an
    address); the address checks then decide.
    """
    hostname = (hostname or socket.gethostname()).lower()
    short = hostname.split(".")[0]
    for j, node in enumerate(topology.nodes):
        name = node.host.lower().rsplit("@", 1)[-1]
        if _is_address(name):
            continue  # an address says nothing about the host name; the address checks decide
        if name in (hostname, short) or name.split(".")[0] == short:
            if j == index:
                return None
            return (
                f"rank {index} runs on {hostname}, which is nodes[{j}] in {topology.source or 'the topology'}: "
                f"rank i runs on nodes[i], so the hostfile must list the hosts in the topology's node order "
                f"({', '.join(topology.hosts)})"
            )
    return None


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def node_checks(
    topology: Topology,
    index: int,
    states: dict[str, InterfaceState] | None = None,
    sysfs: Path = Path("/sys"),
    memory_bytes: int | None = None,
    gpu_count: int | None = None,
) -> list[Check]:
    """Every check of this host against `nodes[index]`."""
    states = interface_states() if states is None else states
    node = topology.nodes[index]
    out: list[Check] = []
    for k, iface in enumerate(node.interfaces):
        st = states.get(iface.name, InterfaceState(iface.name, exists=False))
        found = _interface_checks(topology, iface, st, states, sysfs)
        where = f"nodes[{index}].interfaces[{k}]"
        out += [Check(node.host, f"{iface.name} {what}", status, detail, field.replace("@", where))
                for what, status, detail, field in found]
    if memory_bytes is not None:
        have = memory_bytes / GiB
        status = WARN if node.memory_gib > have * 1.02 else OK
        out.append(Check(node.host, "memory", status, f"topology {node.memory_gib:g} GiB, this host {have:.1f} GiB",
                         f"nodes[{index}].memory_gib"))
    if gpu_count is not None:
        status = FAIL if gpu_count < node.gpus else OK
        out.append(Check(node.host, "gpus", status, f"topology {node.gpus}, this host {gpu_count}",
                         f"nodes[{index}].gpus"))
    return out


def _interface_checks(topology: Topology, iface, st: InterfaceState, states, sysfs: Path) -> list[tuple]:
    """(what, status, detail, field) for one configured netdev; "@" in field stands for its path."""
    if not st.exists:
        others = ", ".join(sorted(states)) or "none"
        return [("exists", FAIL, f"no interface {iface.name} on this host (it has: {others})", "@.name")]
    out = [("exists", OK, "present", "@.name")]
    if not st.admin_up:
        out.append(("up", FAIL, f"{iface.name} is down (ip link set {iface.name} up)", "@"))
    elif not st.running:
        out.append(("up", FAIL, f"{iface.name} is up but has no carrier (cable, or the peer's port is down)", "@"))
    else:
        out.append(("up", OK, "up, carrier", "@"))
    if st.carries(iface.address):
        out.append(("address", OK, str(iface.address), "@.address"))
    else:
        out.append(("address", FAIL, f"{iface.address} is not on {iface.name} (it has {st.describe_addresses()})",
                    "@.address"))
    mtu = topology.link.mtu
    if st.mtu == mtu:
        out.append(("mtu", OK, str(st.mtu), "link.mtu"))
    else:
        out.append(("mtu", FAIL, f"MTU {st.mtu}, the topology's link.mtu is {mtu} "
                    f"(ip link set {iface.name} mtu {mtu}, on both nodes)", "link.mtu"))
    want = topology.link.bandwidth_gbps
    if st.speed_mbps is None:
        out.append(("speed", OK, "not reported by the driver", "link.bandwidth_gbps"))
    elif st.speed_mbps < want * 1000:
        out.append(("speed", WARN, f"{st.speed_mbps / 1000:g} Gb/s, the topology's link.bandwidth_gbps is {want:g}",
                    "link.bandwidth_gbps"))
    else:
        out.append(("speed", OK, f"{st.speed_mbps / 1000:g} Gb/s", "link.bandwidth_gbps"))
    if iface.rdma:
        netdevs = rdma_netdevs(iface.rdma, sysfs)
        if netdevs is None:
            out.append(("rdma", FAIL, f"no RDMA device {iface.rdma} (ibdev2netdev lists them)", "@.rdma"))
        elif iface.name not in netdevs:
            on = ", ".join(sorted(netdevs)) or "no netdev"
            out.append(("rdma", FAIL, f"RDMA device {iface.rdma} is on {on}, not {iface.name}", "@.rdma"))
        else:
            out.append(("rdma", OK, f"{iface.rdma} on {iface.name}", "@.rdma"))
    return out


_FATAL = ("exists", "up", "address", "rdma")  # without these a transport would have to use another path


def require_node_ready(
    topology: Topology,
    index: int,
    states: dict[str, InterfaceState] | None = None,
    hostname: str | None = None,
    warn: Callable[[str], None] | None = None,
    sysfs: Path = Path("/sys"),
) -> None:
    """Raise `ConfigError` unless this host can be `nodes[index]` with all its interfaces usable."""
    node = topology.nodes[index]
    problem = identity_problem(topology, index, hostname)
    if problem:
        raise topology.error(f"nodes[{index}].host", problem)
    for check in node_checks(topology, index, states, sysfs=sysfs):
        what = check.name.rsplit(" ", 1)[-1]
        if check.failed and what in _FATAL:
            raise ConfigError(
                f"node {node.host} (rank {index}): {check.detail}; not starting on another interface",
                file=topology.source, field=check.field, line=_line(topology, check.field),
            )
        if check.status != OK and warn is not None:
            warn(f"node {node.host} (rank {index}): {check.detail}")


def _line(topology: Topology, field: str | None) -> int | None:
    return topology.error(field, "").line if field else None
