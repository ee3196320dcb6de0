"""Run under `mpirun -np 2 python fused_job.py CHECKPOINT OUT_DIR` by test_fused_layer.py: every
rank loads its bf16 shard and runs `invariance_support.fused_and_plain`; rank 0 saves both runs'
logits and how many layers each rank fused to OUT_DIR/rank0.pt."""

import sys
from pathlib import Path

import torch
from invariance_support import fused_and_plain

from hetero_run.launch.bootstrap import LaunchSettings, launched
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext


def main(path: str, out_dir: str) -> None:
    with launched(LaunchSettings(peer_timeout_s=60)) as dist:
        ctx = ParallelContext.from_dist(dist)
        model = load_model(path, ctx, dtype=torch.bfloat16, max_tokens=64)
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.world_size)]
        torch.distributed.all_gather(counts, torch.tensor([model.fused_layers]), group=dist.group)
        fused, plain = fused_and_plain(model)
        if dist.rank == 0:
            torch.save({"fused": fused, "plain": plain, "fused_layers": [int(c) for c in counts]},
                       Path(out_dir) / "rank0.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
