"""Real `mpirun -np 2` (gloo): the driver on rank 0, the target split over two ranks.

Rank 0 holds the drafter and the tokenizers and drives every round through `TargetRunner`
(verify = one tensor-parallel forward, commit = one truncate broadcast); rank 1 only serves
those commands. Greedy output must be token-identical to `--algorithm none` (and to
transformers alone) for every algorithm, and rank 1 must have served exactly the commands
rank 0 sent.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import speculative_support as support
from support import env_for_tests, mpirun_argv

pytestmark = pytest.mark.mpi
JOB = Path(__file__).with_name("driver_job.py")
PROMPTS = ["def is_prime(n):\n", "naïve café résumé — 你"]
ALGORITHMS = ["none", "slem", "tli", "slrs", "auto"]


def test_two_ranks_generate_what_the_target_alone_generates(tmp_path):
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target_tok, drafter_tok = support.byte_level(), support.sentencepiece()
    target = support.trained_model(target_tok, "qwen2", seed=0)
    target.save_pretrained(target_dir)
    target_tok.save_pretrained(target_dir)
    support.trained_model(drafter_tok, "llama", seed=1).save_pretrained(drafter_dir)
    drafter_tok.save_pretrained(drafter_dir)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"target": str(target_dir), "drafter": str(drafter_dir), "algorithms": ALGORITHMS,
                                "prompts": PROMPTS, "new_tokens": 32}))
    proc = subprocess.run(mpirun_argv(2) + [sys.executable, str(JOB), str(spec), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env_for_tests())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "rank0.json").read_text())
    assert out["world_size"] == 2
    results = out["results"]
    for i, prompt in enumerate(PROMPTS):
        expected = support.reference_greedy(target, target_tok(prompt)["input_ids"], 32)
        for algorithm in ALGORITHMS:
            assert results[algorithm][i]["ids"] == expected, (algorithm, prompt)
    assert sum(run["accepted"] for run in results["slem"]) > 0
    assert (tmp_path / "rank1.commands").read_text() == (tmp_path / "rank0.commands").read_text()
