"""Real `mpirun -np 2` (gloo): the target split over two ranks, the EAGLE-3 head on rank 0.

Rank 0 captures the aux states of its replicated residual stream (rank 1 keeps none, and no
collective is added: rank 1 serves exactly the commands rank 0 sent), drafts with the head and
verifies through the tensor-parallel target. Greedy output must equal the target alone's (at
TP=2, and transformers' at TP=1) for heads in each layout on qwen3 and qwen3_moe; sampled
output must follow the target's exact distribution.
"""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import speculative_support as support
import torch
from conftest import head_dir, target_dir
from sampling import PROMPT, SAMPLING, chi_square_p_value, exact_joint
from support import env_for_tests, mpirun_argv
from transformers import AutoModelForCausalLM, AutoTokenizer

from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner

pytestmark = pytest.mark.mpi
JOB = Path(__file__).with_name("eagle3_job.py")
PROMPTS = ["def add(a, b):\n", "The cat sat on"]
NEW = 24
SAMPLED_RUNS = 600


def test_two_ranks_draft_with_eagle3_losslessly(tmp_path):
    cases = [{"target": str(target_dir(arch)), "head": str(head_dir(arch, layout, "aligned")), "arch": arch}
             for arch, layout in (("qwen3", "eagle"), ("qwen3", "vllm"), ("qwen3_moe", "modelopt"))]
    cases[0]["sampled_runs"] = SAMPLED_RUNS
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": cases, "prompts": PROMPTS, "new_tokens": NEW, "sample_prompt": PROMPT,
                                "sampling": {"temperature": SAMPLING.temperature, "top_k": SAMPLING.top_k}}))
    proc = subprocess.run(mpirun_argv(2) + [sys.executable, str(JOB), str(spec), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env_for_tests())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "rank0.json").read_text())
    assert out["world_size"] == 2
    for case, result in zip(cases, out["results"], strict=True):
        tokenizer = AutoTokenizer.from_pretrained(case["target"])
        reference = AutoModelForCausalLM.from_pretrained(case["target"], dtype=torch.float32).eval()
        for i, prompt in enumerate(PROMPTS):
            assert result["eagle3"][i] == result["none"][i], (case, prompt)
            assert result["eagle3"][i] == support.reference_greedy(reference, tokenizer(prompt)["input_ids"], NEW)
        assert result["accepted"] > 0.1 * result["drafted"], case
    assert json.loads((tmp_path / "rank1.commands").read_text()) == json.loads(
        (tmp_path / "rank0.commands").read_text())
    sampled = out["results"][0]["sampled"]
    tokenizer = AutoTokenizer.from_pretrained(cases[0]["target"])
    runner = TargetRunner(load_model(cases[0]["target"], max_tokens=64, dtype=torch.float32))
    expected = exact_joint(runner, tokenizer(PROMPT)["input_ids"])
    counts = Counter(tuple(ids) for ids in sampled)
    assert chi_square_p_value(counts, expected, SAMPLED_RUNS) > 1e-3, counts.most_common(5)
