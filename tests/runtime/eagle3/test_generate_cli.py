"""`hetero-run generate --drafter eagle3:DIR` under real `mpirun -np 2`: the head drafts on rank 0
from the hidden states of rank 0's shard; the output is the target alone's."""

from __future__ import annotations

import json

import pytest
from conftest import head_dir, target_dir


@pytest.mark.mpi
def test_tp2_eagle3_generation_is_identical_to_the_target_alone(run_cli):
    target, head = target_dir("qwen3"), head_dir("qwen3", "eagle", "aligned")
    out = run_cli("generate", "--target", target, "--drafter", f"eagle3:{head}", "--algorithm", "eagle3",
                  "--prompt", "def add(a, b):", "--max-new-tokens", "24", "--dtype", "fp32", "--ignore-eos",
                  "--json", "--compare", np=2, timeout=300)
    assert out.returncode == 0, out.output
    (result,) = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert result["identical"] is True and result["algorithm"] == "eagle3" and result["new_tokens"] == 24
    assert result["acceptance_rate"] > 0 and result["rounds"] < 24, "the head's drafts must be accepted sometimes"


def test_a_directory_that_is_not_a_head_is_a_one_line_error(run_cli):
    target = target_dir("qwen3")
    out = run_cli("generate", "--target", target, "--drafter", f"eagle3:{target}", "--prompt", "hi",
                  "--max-new-tokens", "4", "--dtype", "fp32")
    assert out.returncode == 2, out.output
    assert str(target) in out.stderr and "Traceback" not in out.output, out.output
