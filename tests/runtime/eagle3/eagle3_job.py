"""Run under `mpirun -np 2 python eagle3_job.py SPEC.json OUT_DIR` by test_eagle3_mpi.py.

For each case every rank loads its shard of the target; rank 0 also loads the EAGLE-3 head
(reading the embedding rows rank 1 holds from the target checkpoint when the head has none)
and generates each prompt greedily with `none` and `eagle3`, then the sampled runs, over one
`TargetRunner`; rank 1 only serves. Rank 0 writes OUT_DIR/rank0.json; every rank writes how
many commands it sent or served per case to OUT_DIR/rank<N>.commands.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.launch.bootstrap import LaunchSettings, launched
from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.eagle3 import load_eagle3
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.runner import TargetRunner, serve_worker
from hetero_run.runtime.speculative.config import SpeculationConfig


class CountingRunner(TargetRunner):
    sent = 0

    def step(self, batch):
        self.sent += 1
        return super().step(batch)


def drive(runner, model, case: dict, spec: dict) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(case["target"])
    drafter = load_eagle3(case["head"], model, tokenizer, target_source=case["target"])
    plain = SpeculativeEngine(runner, tokenizer, None, SpeculationConfig(algorithm="none"))
    eagle = SpeculativeEngine(runner, tokenizer, drafter, SpeculationConfig(algorithm="eagle3"))
    out = {"none": [], "eagle3": [], "accepted": 0, "drafted": 0}
    for prompt in spec["prompts"]:
        out["none"].append(plain.generate(prompt, spec["new_tokens"], stop_ids=set()).token_ids)
        result = eagle.generate(prompt, spec["new_tokens"], stop_ids=set())
        out["eagle3"].append(result.token_ids)
        out["accepted"] += result.accepted
        out["drafted"] += result.drafted
    runs = case.get("sampled_runs", 0)
    if runs:
        fixed = SpeculativeEngine(runner, tokenizer, drafter,
                                  SpeculationConfig(algorithm="eagle3", draft_len=3, adaptive=False))
        sampling = SamplingParams(**spec["sampling"])
        out["sampled"] = [fixed.generate(spec["sample_prompt"], 3, replace(sampling, seed=s), stop_ids=set()).token_ids
                          for s in range(runs)]
    return out


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    results, counts = [], []
    with launched(LaunchSettings(peer_timeout_s=120)) as dist:
        ctx = ParallelContext.from_dist(dist)
        for case in spec["cases"]:
            model = load_model(case["target"], ctx, dtype=torch.float32, max_tokens=256)
            if not dist.is_driver:
                counts.append(serve_worker(model, ctx))
                continue
            with CountingRunner(model, ctx) as runner:
                results.append(drive(runner, model, case, spec))
            counts.append(runner.sent)
        if dist.is_driver:
            (out / "rank0.json").write_text(json.dumps({"results": results, "world_size": dist.world_size}))
        (out / f"rank{dist.rank}.commands").write_text(json.dumps(counts))


if __name__ == "__main__":
    main(*sys.argv[1:])
