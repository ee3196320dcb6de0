"""A verify forward of n tokens equals n one-token decode forwards bit for bit (logits and KV cache),
for every architecture, bf16 and NVFP4 checkpoints, at TP=1 and over `mpirun -np 2`: the property
that makes greedy speculative decoding emit exactly the target's own tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from invariance_support import mismatches
from support import env_for_tests, mpirun_argv
from tiny_models import ARCHITECTURES, tiny_checkpoint

from hetero_run.runtime.models.loader import load_model

JOB = Path(__file__).with_name("invariance_job.py")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_multi_token_forward_equals_one_token_forwards(arch, quant, dtype):
    model = load_model(tiny_checkpoint(arch, quant), dtype=dtype, max_tokens=128)
    assert mismatches(model, seed=len(arch)) == []


def _batch_dependent_linear(x: torch.Tensor, w: torch.Tensor, float_out: bool = False) -> torch.Tensor:
    """x @ w.T summed in as many pieces of the input dimension as x has rows: a product whose
    summation order follows the batch size, as a shape-tuned GEMM's may."""
    pieces = torch.tensor_split(torch.arange(x.shape[1]), min(x.shape[0], x.shape[1]))
    y = sum(x[:, p] @ w[:, p].to(x.dtype).T for p in pieces)  # each piece rounded to x's dtype
    return y.float() if float_out else y


def test_the_check_sees_a_batch_dependent_model(monkeypatch):
    # With a linear product whose rows depend on the batch, rows differ, and the check says so.
    from hetero_run.runtime import weights

    model = load_model(tiny_checkpoint("qwen3", "bf16"), dtype=torch.bfloat16, max_tokens=128)
    monkeypatch.setattr(weights, "dense_linear", _batch_dependent_linear)
    found = mismatches(model, sizes=(5, 13))
    assert any("logits differ" in line for line in found), found


@pytest.mark.mpi
def test_two_ranks_multi_token_forward_equals_one_token_forwards(tmp_path):
    cases = [{"name": f"{arch}-{quant}", "path": str(tiny_checkpoint(arch, quant)), "dtype": "bfloat16",
              "seed": i, "sizes": [2, 5, 13, 25, 32]}
             for i, (arch, quant) in enumerate((a, q) for a in ARCHITECTURES for q in ("bf16", "nvfp4"))]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    proc = subprocess.run(mpirun_argv(2) + [sys.executable, str(JOB), str(spec), str(tmp_path)],
                          capture_output=True, text=True, timeout=900,
                          env=env_for_tests({"PYTHONPATH": str(Path(__file__).parents[2])}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(found) == {c["name"] for c in cases}
        assert {name: bad for name, bad in found.items() if bad} == {}, f"rank {rank}"
