"""Two "hosts" on one machine: network namespaces joined by veth pairs.

The QSFP cable is a veth pair whose interface names, addresses and MTU are read from the
topology YAML the test writes. A second veth pair is the management LAN that mpirun's own
control traffic uses (as ssh does between real machines), so taking the QSFP link down
leaves mpirun able to report both ranks. Each namespace gets its own host name (a UTS
namespace per process tree), and mpirun reaches the "remote" host through an agent script
that runs `ip netns exec HOST ...` in place of ssh. All addresses are from 198.18.0.0/15.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import env_for_tests

LAN = ("198.19.0.1/24", "198.19.0.2/24")
LAN_CIDR = "198.19.0.0/24"

AGENT = """\
#!/bin/sh
# mpirun's "ssh": run the daemon's command line on HOST = a network namespace of that name.
host=$1; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host && $*"
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class TwoHosts:
    hosts: tuple[str, str]  # = namespace names = host names
    qsfp: tuple[str, str]  # interface names, from the topology
    lan: tuple[str, str]
    topology: Path
    hostfile: Path
    agent: Path

    def in_host(self, host: str, argv: list[str]) -> list[str]:
        """argv run inside `host` (its namespace, with its host name)."""
        return ["ip", "netns", "exec", host, "unshare", "--uts", "sh", "-c",
                f'hostname {host} && exec "$@"', "sh", *argv]

    def mpirun(self, argv: list[str]) -> list[str]:
        """A printed `mpirun ...` line, run from the first host, reaching the second via the agent."""
        assert Path(argv[0]).name == "mpirun", argv
        agent = ["--prtemca", "plm_ssh_agent", str(self.agent), "--prtemca", "oob_tcp_if_include", LAN_CIDR]
        return self.in_host(self.hosts[0], [argv[0], *agent, *argv[1:]])

    def bytes(self, which: int, dev: str) -> int:
        """rx + tx bytes of `dev` in host `which`."""
        out = _ip("-n", self.hosts[which], "-s", "-j", "link", "show", "dev", dev).stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]

    def set_link(self, which: int, up: bool) -> None:
        _ip("-n", self.hosts[which], "link", "set", self.qsfp[which], "up" if up else "down")

    def wait_for_carrier(self, timeout: float = 10.0) -> None:
        """Until every link of both hosts has carrier (a fresh veth pair takes a moment)."""
        links = [(h, i) for n, h in enumerate(self.hosts) for i in (self.qsfp[n], self.lan[n])]
        end = time.monotonic() + timeout
        while not all("LOWER_UP" in _ip("-n", h, "link", "show", "dev", i).stdout for h, i in links):
            if time.monotonic() > end:
                raise RuntimeError(f"no carrier on the test links after {timeout} s")
            time.sleep(0.1)

    def pids(self, which: int) -> list[int]:
        out = _ip("netns", "pids", self.hosts[which], check=False).stdout
        return [int(p) for p in out.split()]

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.mpirun(argv), capture_output=True, text=True, timeout=timeout,
                              env=env_for_tests(), cwd=str(self.topology.parent))

    def popen(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(self.mpirun(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env_for_tests(), cwd=str(self.topology.parent), start_new_session=True)

    def write_topology(self, path: Path, addresses: tuple[str, str] = ("198.18.0.1/24", "198.18.0.2/24")) -> Path:
        from hetero_run.topology.config import load_topology

        port = load_topology(self.topology).rendezvous_port
        return write_pair_topology(path, self.hosts, self.qsfp, port, addresses)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: creates network namespaces and veth pairs"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` to build the two hosts"
    return None


def write_pair_topology(path: Path, hosts: tuple[str, str], qsfp: tuple[str, str], port: int,
                        addresses: tuple[str, str] = ("198.18.0.1/24", "198.18.0.2/24")) -> Path:
    path.write_text(textwrap.dedent(f"""\
        # Two hosts in network namespaces; the veth pair between them stands in for the QSFP cable.
        tensor_parallel_size: 2
        rendezvous_port: {port}
        link: {{bandwidth_gbps: 10, mtu: 9000}}
        nodes:
          - host: {hosts[0]}
            memory_gib: 2
            gpus: 0
            interfaces: [{{name: {qsfp[0]}, address: {addresses[0]}}}]
          - host: {hosts[1]}
            memory_gib: 2
            gpus: 0
            interfaces: [{{name: {qsfp[1]}, address: {addresses[1]}}}]
        """))
    return path


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Two namespaces as in the topology YAML; torn down (processes first) even when a test fails."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from hetero_run.topology.config import load_topology
    from hetero_run.topology.hostfile import write_hostfile

    tag = f"{os.getpid() % 100000}"
    tmp = tmp_path_factory.mktemp("two-hosts")
    # The test's own choice of names; everything below reads them back from the YAML.
    port = 29400 + int(tag) % 500
    path = write_pair_topology(tmp / "pair.yaml", (f"hr{tag}a", f"hr{tag}b"), (f"q{tag}a", f"q{tag}b"), port)
    topology = load_topology(path)
    hosts = topology.hosts
    qsfp = tuple(n.primary.name for n in topology.nodes)
    lan = (f"l{tag}a", f"l{tag}b")
    agent = tmp / "agent.sh"
    agent.write_text(AGENT)
    agent.chmod(0o755)
    pair = TwoHosts(hosts, qsfp, lan, path, write_hostfile(tmp / "pair.hosts", topology), agent)
    created: list[str] = []
    try:
        for host in hosts:
            made = _ip("netns", "add", host, check=False)
            if made.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
            created.append(host)
            _ip("-n", host, "link", "set", "lo", "up")
        _ip("link", "add", qsfp[0], "netns", hosts[0], "type", "veth", "peer", "name", qsfp[1], "netns", hosts[1])
        _ip("link", "add", lan[0], "netns", hosts[0], "type", "veth", "peer", "name", lan[1], "netns", hosts[1])
        for i, node in enumerate(topology.nodes):
            iface = node.primary
            _ip("-n", hosts[i], "addr", "add", str(iface.address), "dev", iface.name)
            _ip("-n", hosts[i], "link", "set", iface.name, "mtu", str(topology.link.mtu), "up")
            _ip("-n", hosts[i], "addr", "add", LAN[i], "dev", lan[i])
            _ip("-n", hosts[i], "link", "set", lan[i], "up")
        pair.wait_for_carrier()
        yield pair
    finally:
        for host in created:
            for pid in pair.pids(hosts.index(host)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.2)
        for host in created:
            _ip("netns", "del", host, check=False)

