"""All-reduce through shared memory, for tensor-parallel ranks that share one host (CPU, gloo).

A decode step does two small all-reduces per layer; over gloo's TCP loopback each costs a
round trip through the kernel and gloo's threads (about 100-200 us on a 2-core host), over
shared memory a copy and a few loads. Each rank writes its tensor into its own slot, publishes
the round number, waits until every other rank has published the same round, and sums the
slots in rank order, so every rank computes bit-identical sums.

Slots alternate between two banks by round parity. A rank can start round s + 2 (reusing
bank s % 2) only after every peer published round s + 1, which each does only after it
finished reading round s: nothing is overwritten while it is still being read.

Ordering relies on x86-64's total store order (data is stored before the round number, and
loaded after it), so this path is only used on x86-64; elsewhere, and for tensors larger than
a slot, the caller falls back to the process group.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time

import numpy as np
import torch

SLOT_BYTES = 1 << 20  # larger tensors (long prompts) go through the process group
COUNTER_STRIDE = 8  # int64s between two ranks' round numbers: one cache line each
SPIN = 2000  # busy polls before yielding the core (about 100 us)


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedMemoryAllReduce:
    def __init__(self, buffer: mmap.mmap, rank: int, size: int, timeout_s: float = 600.0, spin: int = SPIN):
        header = size * COUNTER_STRIDE * 8
        self._buffer = buffer
        self.rounds = np.frombuffer(buffer, dtype=np.int64, count=size * COUNTER_STRIDE)
        self.slots = torch.frombuffer(buffer, dtype=torch.uint8, offset=header,
                                      count=2 * size * SLOT_BYTES).view(2, size, SLOT_BYTES)
        self.rank, self.size, self.timeout_s, self.spin = rank, size, timeout_s, spin
        self.round = 0

    @classmethod
    def create(cls, group, rank: int, size: int) -> SharedMemoryAllReduce:
        """Collective over `group`: rank 0 makes the segment, the others map it, then its name
        is removed (the mapping lives on until every rank exits, crashes included)."""
        import torch.distributed as tdist

        nbytes = size * COUNTER_STRIDE * 8 + 2 * size * SLOT_BYTES
        path = [None]
        if rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            fd, path[0] = tempfile.mkstemp(prefix="hetero-run-allreduce-", dir=folder)
            os.ftruncate(fd, nbytes)
            os.close(fd)
        tdist.broadcast_object_list(path, group=group, group_src=0)
        with open(path[0], "r+b") as f:
            buffer = mmap.mmap(f.fileno(), nbytes)
        tdist.barrier(group=group)
        if rank == 0:
            os.unlink(path[0])
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return cls(buffer, rank, size, spin=SPIN if size <= cores else 0)  # more ranks than cores: never spin

    def __call__(self, x: torch.Tensor) -> bool:
        """Sum `x` over the ranks in place; False (nothing done) when it does not fit a slot."""
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES or not x.is_contiguous() or x.device.type != "cpu":
            return False
        self.round += 1
        bank = self.slots[self.round & 1]  # [size, SLOT_BYTES]
        bank[self.rank, :nbytes].copy_(x.view(-1).view(torch.uint8))
        self.rounds[self.rank * COUNTER_STRIDE] = self.round  # published after the data
        for peer in range(self.size):
            if peer != self.rank:
                self._wait(peer)
        parts = bank[:, :nbytes].view(x.dtype).view(self.size, *x.shape)
        if self.size == 2:
            torch.add(parts[0], parts[1], out=x)
        else:
            torch.sum(parts, dim=0, out=x)
        return True

    def _wait(self, peer: int) -> None:
        rounds, i, target = self.rounds, peer * COUNTER_STRIDE, self.round
        spins = 0
        deadline = None
        while rounds[i] < target:
            spins += 1
            if spins > self.spin:  # the peer is not running right now: give the core (and the GIL) away
                time.sleep(0)
                if spins % 4096 == 0:
                    deadline = deadline or time.monotonic() + self.timeout_s
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"shared-memory all-reduce: rank {peer} did not reach round {target} "
                                           f"within {self.timeout_s:g} s")
