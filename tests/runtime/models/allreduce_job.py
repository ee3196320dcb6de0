"""Run under `mpirun -np N python allreduce_job.py OUT_DIR` by test_parallel.py: every rank sums
the same sequence of tensors with ParallelContext (shared memory where it applies) and with
plain gloo, and writes both to OUT_DIR/rank<N>.pt."""

import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from hetero_run.launch.bootstrap import LaunchSettings, launched
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.models.shm_allreduce import SLOT_BYTES

CASES = [((1, 896), torch.bfloat16), ((5, 896), torch.float32), ((1, 7), torch.float32), ((3, 64), torch.bfloat16),
         ((SLOT_BYTES // 4 + 1,), torch.float32)] * 3  # repeated: both banks reused; the last is too big


def main(out_dir: str) -> None:
    with launched(LaunchSettings(peer_timeout_s=60)) as dist:
        ctx = ParallelContext.from_dist(dist)
        g = torch.Generator().manual_seed(100 + dist.rank)
        ours, gloo = [], []
        for shape, dtype in CASES:
            x = torch.randn(shape, generator=g).to(dtype)
            y = x.clone()
            ctx.all_reduce(x)
            tdist.all_reduce(y, group=dist.group)
            ours.append(x)
            gloo.append(y)
        rounds = ctx.local_reduce.round if ctx.local_reduce is not None else None
        torch.save({"ours": ours, "gloo": gloo, "rounds": rounds}, Path(out_dir) / f"rank{dist.rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
