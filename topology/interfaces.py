"""Facts about this host's network interfaces: state, MTU, addresses, routes, RDMA devices.

psutil gives flags, MTU, speed and addresses; the kernel's route choice comes from
`ip route get`; the netdev behind an RDMA device from sysfs (what `ibdev2netdev` prints).
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class InterfaceState:
    name: str
    exists: bool
    admin_up: bool = False  # IFF_UP: `ip link set NAME up`
    running: bool = False  # IFF_RUNNING: up with a carrier (cable in, peer end up)
    mtu: int | None = None
    speed_mbps: int | None = None  # None when the driver does not say
    addresses: tuple[ipaddress.IPv4Interface, ...] = ()

    def carries(self, address: ipaddress.IPv4Interface) -> bool:
        return address in self.addresses

    def describe_addresses(self) -> str:
        return ", ".join(str(a) for a in self.addresses) or "no IPv4 address"


def interface_states() -> dict[str, InterfaceState]:
    """Every interface of this host (of this network namespace)."""
    import psutil

    addrs = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    out = {}
    for name in sorted(set(addrs) | set(stats)):
        st = stats.get(name)
        flags = set(st.flags.split(",")) if st and st.flags else set()
        v4 = tuple(
            ipaddress.IPv4Interface(f"{a.address}/{a.netmask}")
            for a in addrs.get(name, ())
            if a.family == socket.AF_INET and a.netmask
        )
        out[name] = InterfaceState(
            name=name,
            exists=True,
            admin_up="up" in flags,
            running=bool(st and st.isup),
            mtu=st.mtu if st else None,
            speed_mbps=(st.speed or None) if st else None,
            addresses=v4,
        )
    return out


def interface_state(name: str, states: dict[str, InterfaceState] | None = None) -> InterfaceState:
    states = interface_states() if states is None else states
    return states.get(name, InterfaceState(name=name, exists=False))


@dataclass(frozen=True)
class Route:
    dev: str
    src: str | None


def route_to(dest: str, source: str | None = None) -> Route | None:
    """The kernel's route for `dest` (from `source`): `ip -o route get`. None when unreachable."""
    ip = shutil.which("ip") or ("/usr/sbin/ip" if Path("/usr/sbin/ip").exists() else None)
    if ip is None:
        raise FileNotFoundError("`ip` (iproute2) is not installed")
    argv = [ip, "-o", "route", "get", dest] + (["from", source] if source else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        return None
    return parse_route(proc.stdout)


def parse_route(text: str) -> Route | None:
    """"198.18.0.2 dev qsfp0 src 198.18.0.1 uid 0 \\    cache" -> Route("qsfp0", "198.18.0.1")."""
    words = text.split()
    if "dev" not in words:
        return None
    dev = words[words.index("dev") + 1]
    src = words[words.index("src") + 1] if "src" in words else None
    return Route(dev, src)


def rdma_netdevs(device: str, sysfs: Path = Path("/sys")) -> set[str] | None:
    """Netdevs behind RDMA device `device` (None when the device does not exist)."""
    base = sysfs / "class" / "infiniband" / device
    if not base.exists():
        return None
    net = base / "device" / "net"
    found = {p.name for p in net.iterdir()} if net.is_dir() else set()
    return found
