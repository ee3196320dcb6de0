"""Run under `mpirun -np N python invariance_job.py SPEC.json OUT_DIR` (tests/ on PYTHONPATH): every
rank loads its shard of each case's checkpoint and runs `invariance_support.mismatches`; rank r
writes OUT_DIR/rank<r>.json, {case name: [mismatches]}."""

import json
import sys
from pathlib import Path

import torch
from invariance_support import mismatches

from hetero_run.launch.bootstrap import LaunchSettings, launched
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.parallel import ParallelContext


def main(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    with launched(LaunchSettings(peer_timeout_s=60)) as dist:
        ctx = ParallelContext.from_dist(dist)
        found = {}
        for case in spec["cases"]:
            model = load_model(case["path"], ctx, dtype=getattr(torch, case["dtype"]), max_tokens=128)
            found[case["name"]] = mismatches(model, seed=case["seed"], sizes=tuple(case["sizes"]))
        (Path(out_dir) / f"rank{dist.rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(*sys.argv[1:])
