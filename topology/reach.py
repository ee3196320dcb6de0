"""Do the nodes reach each other over the configured link, and not over another route?

For every peer and every cable path k (`interfaces[k]` of both nodes):
  route    the kernel's route to the peer's address goes out of our interfaces[k];
  connect  a TCP connection from our interfaces[k] address reaches the peer's listener on its
           interfaces[k] address;
  arrival  the peer's connection reached our interfaces[k] listener from its configured address.

Ranks exchange listener ports through `all_gather(obj) -> list` (the caller's process group),
so this module needs no torch.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from hetero_run.topology.checks import FAIL, OK, Check
from hetero_run.topology.interfaces import Route, route_to
from hetero_run.topology.schema import Topology

AllGather = Callable[[object], list]


class Listeners:
    """One TCP listener on each configured address of this node; records who connected."""

    def __init__(self, topology: Topology, rank: int, timeout_s: float):
        self.rank = rank
        self.arrivals: list[tuple[int, str, str]] = []  # (k, source address, hello)
        self._lock = threading.Lock()
        self._socks = []
        for iface in topology.nodes[rank].interfaces:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((iface.ip, 0))
            sock.listen(16)
            sock.settimeout(0.2)
            self._socks.append(sock)
        self._stop = threading.Event()
        self._timeout_s = timeout_s
        self._threads = [threading.Thread(target=self._serve, args=(k,), daemon=True)
                         for k in range(len(self._socks))]
        for t in self._threads:
            t.start()

    def arrived(self) -> list[tuple[int, str, str]]:
        with self._lock:
            return list(self.arrivals)

    @property
    def ports(self) -> list[int]:
        return [s.getsockname()[1] for s in self._socks]

    def _serve(self, k: int) -> None:
        sock = self._socks[k]
        while not self._stop.is_set():
            try:
                conn, (addr, _) = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(self._timeout_s)
                try:
                    hello = conn.recv(64).decode(errors="replace").strip()
                except OSError:
                    hello = ""
                # recorded before the reply: a peer that has its answer (and then meets this
                # rank at the all_gather) finds its arrival here, however late this thread runs
                with self._lock:
                    self.arrivals.append((k, addr, hello))
                try:
                    conn.sendall(f"ok {self.rank} {k}\n".encode())
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1.0)
        for s in self._socks:
            s.close()


def link_checks(
    topology: Topology,
    rank: int,
    all_gather: AllGather,
    timeout_s: float = 5.0,
    route: Callable[[str, str | None], Route | None] = route_to,
) -> list[Check]:
    """Route, connect and arrival checks between this rank's node and every other node."""
    node = topology.nodes[rank]
    listeners = Listeners(topology, rank, timeout_s)
    try:
        ports = all_gather(listeners.ports)
        out: list[Check] = []
        for peer_rank, peer in enumerate(topology.nodes):
            if peer_rank == rank:
                continue
            for k, (mine, theirs) in enumerate(zip(node.interfaces, peer.interfaces, strict=True)):
                name = f"{mine.name} -> {peer.host} {theirs.ip}"
                field = f"nodes[{rank}].interfaces[{k}]"
                out.append(_route_check(node.host, name, field, mine, theirs, route))
                out.append(_connect_check(node.host, name, field, rank, k, mine.ip, theirs.ip,
                                          ports[peer_rank][k], peer_rank, timeout_s))
        all_gather(None)  # every rank has finished connecting
        for peer_rank, peer in enumerate(topology.nodes):
            if peer_rank == rank:
                continue
            for k, (mine, theirs) in enumerate(zip(node.interfaces, peer.interfaces, strict=True)):
                got = [(addr, hello) for kk, addr, hello in listeners.arrived()
                       if kk == k and hello == f"{peer_rank} {k}"]
                name = f"{mine.name} <- {peer.host} {theirs.ip}"
                field = f"nodes[{peer_rank}].interfaces[{k}]"
                if not got:
                    out.append(Check(node.host, name, FAIL, f"no connection from {peer.host} arrived on {mine.ip}",
                                     field))
                elif all(addr == theirs.ip for addr, _ in got):
                    out.append(Check(node.host, name, OK, f"arrived from {theirs.ip}", field))
                else:
                    seen = ", ".join(sorted({addr for addr, _ in got}))
                    out.append(Check(node.host, name, FAIL, f"{peer.host}'s connection arrived from {seen}, "
                                     f"not from its configured {theirs.ip}", field))
        return out
    finally:
        listeners.close()


def _route_check(host, name, field, mine, theirs, route) -> Check:
    try:
        found = route(theirs.ip, mine.ip)
    except (OSError, FileNotFoundError) as exc:
        return Check(host, f"{name} route", FAIL, f"cannot ask the kernel for the route: {exc}", field)
    if found is None:
        return Check(host, f"{name} route", FAIL, f"no route to {theirs.ip} from {mine.ip}", field)
    if found.dev != mine.name:
        return Check(host, f"{name} route", FAIL,
                     f"the kernel routes {theirs.ip} out of {found.dev}, not {mine.name}", field)
    return Check(host, f"{name} route", OK, f"via {found.dev}", field)


def _connect_check(host, name, field, rank, k, src, dst, port, peer_rank, timeout_s) -> Check:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.bind((src, 0))
            sock.connect((dst, port))
            sock.sendall(f"{rank} {k}\n".encode())
            reply = sock.recv(64).decode(errors="replace").strip()
    except OSError as exc:
        return Check(host, f"{name} connect", FAIL, f"TCP from {src} to {dst}:{port} failed: {exc}", field)
    if reply != f"ok {peer_rank} {k}":
        return Check(host, f"{name} connect", FAIL, f"unexpected answer {reply!r} from {dst}:{port}", field)
    return Check(host, f"{name} connect", OK, f"{src} -> {dst}:{port}", field)
