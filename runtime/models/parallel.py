"""The process group a model shard runs in, and the few collectives tensor parallelism needs.

Model code receives a `ParallelContext`; it never touches torch.distributed globals or MPI.
At size 1 every collective is skipped, so a single process needs no process group at all.
Ranks that share one x86-64 host over gloo sum their small tensors through shared memory
(shm_allreduce.py) instead of the loopback network; HETERO_RUN_SHM_ALLREDUCE=0 turns that off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from hetero_run.runtime.models import shm_allreduce
from hetero_run.topology.errors import ConfigError


@dataclass(frozen=True)
class ParallelContext:
    group: object | None  # torch ProcessGroup; None at size 1
    rank: int = 0  # this process's rank inside `group`
    size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    local_reduce: shm_allreduce.SharedMemoryAllReduce | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is not in a group of size {self.size}", field="parallel")
        if self.size > 1 and self.group is None:
            raise ConfigError(f"a group of size {self.size} needs a process group", field="parallel")

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelContext:
        return cls(None, 0, 1, torch.device(device))

    @classmethod
    def from_dist(cls, dist) -> ParallelContext:
        """From the launch handle (`hetero_run.launch.bootstrap.Dist`); collective over its group."""
        local = None
        one_host = len({peer.host for peer in dist.peers}) == 1
        if (dist.world_size > 1 and dist.backend == "gloo" and one_host and shm_allreduce.supported()
                and os.environ.get("HETERO_RUN_SHM_ALLREDUCE", "1") != "0"):
            local = shm_allreduce.SharedMemoryAllReduce.create(dist.group, dist.rank, dist.world_size)
        return cls(dist.group, dist.rank, dist.world_size, dist.device, local)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` equal parts (heads, vocabulary rows, intermediate size)."""
        if total % self.size:
            raise ConfigError(
                f"{what} = {total} does not divide across {self.size} tensor-parallel ranks",
                field="tensor_parallel",
            )
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns `x`."""
        if self.size > 1 and not (self.local_reduce is not None and self.local_reduce(x)):
            import torch.distributed as tdist

            tdist.all_reduce(x, group=self.group)
        return x

    def gather_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's [n, part] along the last dim on rank 0 -> [n, size * part];
        None on the other ranks."""
        if self.size == 1:
            return x
        import torch.distributed as tdist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        tdist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place; returns `x`."""
        if self.size > 1:
            import torch.distributed as tdist

            tdist.broadcast(x, group=self.group, group_src=0)
        return x
