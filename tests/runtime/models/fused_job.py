"""Run under `mpirun -np 2 python fused_job.py CHECKPOINT OUT_DIR` by test_fused_layer.py: every
rank loads its bf16 shard, runs a prompt, a 5-row verify, a rollback and 3 decode steps with its
layers fused (kernels/decoder_layer.py) and again with them unfused, and rank 0 saves both
runs' logits and how many layers each rank fused to OUT_DIR/rank0.pt."""

import sys
from pathlib import Path

import torch

from hetero_run.launch.bootstrap import LaunchSettings, launched
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext


def script(model) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (30,), generator=g)
    model.truncate(0)
    out = [model.forward(ids[:17], torch.arange(17)), model.forward(ids[17:22], torch.arange(17, 22))]
    model.truncate(19)
    out += [model.forward(ids[22 + i:23 + i], torch.tensor([19 + i])) for i in range(3)]
    return out


def main(path: str, out_dir: str) -> None:
    with launched(LaunchSettings(peer_timeout_s=60)) as dist:
        ctx = ParallelContext.from_dist(dist)
        model = load_model(path, ctx, dtype=torch.bfloat16, max_tokens=64)
        fused_layers = model.fused_layers
        g = torch.Generator().manual_seed(2)  # unit norms and zero biases would hide a mix-up
        for layer in model.layers:
            for t in (layer.input_norm, layer.post_norm, layer.attention.qkv.bias, layer.attention.o.bias):
                if t is not None:
                    t.copy_(1 + 0.5 * torch.randn(t.shape, generator=g))
        fused = script(model)
        for layer in model.layers:
            layer.fused = None
        plain = script(model)
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.world_size)]
        torch.distributed.all_gather(counts, torch.tensor([fused_layers]), group=dist.group)
        if dist.rank == 0:
            torch.save({"fused": fused, "plain": plain, "fused_layers": [int(c) for c in counts]},
                       Path(out_dir) / "rank0.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
