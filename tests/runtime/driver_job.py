"""Run under `mpirun -np N python driver_job.py SPEC.json OUT_DIR` by test_driver_mpi.py.

Every rank loads its shard of the target checkpoint; rank 0 also loads the drafter and both
tokenizers and runs `SpeculativeEngine.generate` once per algorithm of the spec over one
`TargetRunner`, while the other ranks serve it with `serve_worker`. Rank 0 writes the
generated ids per algorithm to OUT_DIR/rank0.json; every rank writes how many commands it
sent or served to OUT_DIR/rank<N>.commands.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.launch.bootstrap import LaunchSettings, launched
from hetero_run.runtime.drafters.load import load_drafter
from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext
from hetero_run.runtime.runner import TargetRunner, serve_worker
from hetero_run.runtime.speculative.config import SpeculationConfig


class CountingRunner(TargetRunner):
    sent = 0

    def step(self, batch):
        self.sent += 1
        return super().step(batch)


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_dir)
    with launched(LaunchSettings(peer_timeout_s=60)) as dist:
        ctx = ParallelContext.from_dist(dist)
        model = load_model(spec["target"], ctx, dtype=torch.float32, max_tokens=256)
        if not dist.is_driver:
            served = serve_worker(model, ctx)
            (out / f"rank{dist.rank}.commands").write_text(str(served))
            return
        tokenizer = AutoTokenizer.from_pretrained(spec["target"])
        drafter = load_drafter(spec["drafter"], dtype=torch.float32)
        results = {}
        with CountingRunner(model, ctx) as runner:
            for algorithm in spec["algorithms"]:
                engine = SpeculativeEngine(runner, tokenizer, drafter if algorithm != "none" else None,
                                           SpeculationConfig(algorithm=algorithm))
                runs = []
                for prompt in spec["prompts"]:
                    sampling = SamplingParams(**spec.get("sampling", {}))
                    result = engine.generate(prompt, spec["new_tokens"], sampling, stop_ids=set())
                    runs.append({"ids": result.token_ids, "accepted": result.accepted, "rounds": result.rounds})
                results[algorithm] = runs
            sent = runner.sent
        (out / "rank0.json").write_text(json.dumps({"results": results, "world_size": dist.world_size}))
        (out / "rank0.commands").write_text(str(sent))


if __name__ == "__main__":
    main(*sys.argv[1:])
