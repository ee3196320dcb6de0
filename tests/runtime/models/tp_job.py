"""Run under `mpirun -np N python tp_job.py SPEC.json OUT_DIR` by the tensor-parallel tests.

For each case of the spec, every rank loads its shard of the checkpoint; rank 0 drives a fixed
script through `TargetRunner` (prompt, verify step, rollback, forward, then 64 greedy tokens
through the generate command's decode loop) and the other ranks serve it with
`serve_worker`. A case may set `embedding_split` (row counts per rank, or "balanced"). Rank 0
saves what it got, and the embedding rows every rank held, to OUT_DIR/rank0.pt; every rank
writes how many commands it sent or served to OUT_DIR/rank<N>.json.
"""

import json
import sys
from pathlib import Path

import torch

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.launch.bootstrap import LaunchSettings, launched
from hetero_run.launch.generate import TargetOnly
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.runner import TargetRunner, serve_worker


def drive(runner: TargetRunner, case: dict) -> dict:
    ids, p, k, a = torch.tensor(case["ids"]), case["prompt"], case["draft"], case["accept"]
    out = {"prompt": runner.forward(ids[:p], torch.arange(p))}
    out["verify"] = runner.forward(ids[p:p + k + 1], torch.arange(p, p + k + 1))
    runner.truncate(p + a)
    after = torch.tensor(case["after"])
    out["after"] = runner.forward(after, torch.arange(p + a, p + a + len(after)))
    out["length"] = runner.length
    greedy = TargetOnly(runner, SamplingParams()).tokens(case["ids"][:p], case["greedy"], set())
    out["greedy"] = [t for chunk in greedy for t in chunk]
    return out


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    with launched(LaunchSettings(peer_timeout_s=60)) as dist:
        ctx = ParallelContext.from_dist(dist)
        results, commands = {}, {}
        for case in spec["cases"]:
            model = load_model(case["path"], ctx, dtype=torch.float32, max_tokens=128,
                               prefill_chunk=case.get("prefill_chunk", 512),
                               embedding_split=case.get("embedding_split", "even"))
            rows = [None] * dist.world_size
            torch.distributed.all_gather_object(rows, model.embed.rows, group=dist.group)
            if dist.is_driver:
                with TargetRunner(model, ctx) as runner:
                    results[case["name"]] = drive(runner, case) | {"embedding_rows": rows}
                prompt_steps = -(-case["prompt"] // case.get("prefill_chunk", 512))  # one step per prefill chunk
                # the prompt, the verify and the forward after it; the decode loop's prompt and decodes
                commands[case["name"]] = prompt_steps + 2 + prompt_steps + case["greedy"] - 1
            else:
                commands[case["name"]] = serve_worker(model, ctx)
        if dist.is_driver:
            torch.save(results, Path(out_dir) / "rank0.pt")
        (Path(out_dir) / f"rank{dist.rank}.json").write_text(json.dumps(commands))


if __name__ == "__main__":
    main(*sys.argv[1:])
