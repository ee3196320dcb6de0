"""Link checks between two ranks, run as two threads over this host's loopback."""

import threading

from hetero_run.topology.config import parse_topology
from hetero_run.topology.interfaces import Route
from hetero_run.topology.reach import link_checks

LOOPBACK_PAIR = """\
tensor_parallel_size: 2
nodes:
  - {host: a, memory_gib: 1, gpus: 0, interfaces: [{name: lo, address: 127.0.0.1/8}]}
  - {host: b, memory_gib: 1, gpus: 0, interfaces: [{name: lo, address: 127.0.0.2/8}]}
"""


class ThreadGather:
    """all_gather for ranks that are threads of this process."""

    def __init__(self, n: int):
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def for_rank(self, rank: int):
        def all_gather(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return all_gather


def run_pair(topology, route=None):
    gather = ThreadGather(2)
    results = [None, None]

    def rank(r):
        kwargs = {"route": route} if route else {}
        results[r] = {c.name: c for c in link_checks(topology, r, gather.for_rank(r), **kwargs)}

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_ranks_reach_each_other_from_their_configured_addresses():
    a, b = run_pair(parse_topology(LOOPBACK_PAIR))
    assert a["lo -> b 127.0.0.2 route"].detail == "via lo"
    assert a["lo -> b 127.0.0.2 connect"].status == "ok"
    assert a["lo <- b 127.0.0.2"].detail == "arrived from 127.0.0.2"
    assert b["lo <- a 127.0.0.1"].detail == "arrived from 127.0.0.1"
    assert all(c.status == "ok" for c in [*a.values(), *b.values()])


def test_route_out_of_another_interface_fails():
    a, b = run_pair(parse_topology(LOOPBACK_PAIR), route=lambda dest, src: Route("eth0", src))
    check = a["lo -> b 127.0.0.2 route"]
    assert check.status == "fail" and check.detail == "the kernel routes 127.0.0.2 out of eth0, not lo"
    assert check.field == "nodes[0].interfaces[0]"


def test_no_route_fails():
    a, _ = run_pair(parse_topology(LOOPBACK_PAIR), route=lambda dest, src: None)
    assert a["lo -> b 127.0.0.2 route"].detail == "no route to 127.0.0.2 from 127.0.0.1"
