"""The fused decoder layer (kernels/decoder_layer.py): one compiled call per layer gives the bits
of the layer's PyTorch operations, for every dense architecture, NVFP4 and bf16 weights, one rank
and two (real `mpirun -np 2`), and applies only where it can."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from invariance_support import fused_and_plain
from support import env_for_tests, mpirun_argv
from tiny_models import ARCHITECTURES, tiny_checkpoint

from hetero_run.kernels import cpu_ext
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.models.moe import SparseMoE

pytestmark = pytest.mark.skipif(cpu_ext.ops() is None, reason="the compiled CPU kernels do not build here")
JOB = Path(__file__).with_name("fused_job.py")


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "qwen3_moe"])
def test_fused_layers_give_the_bits_of_the_unfused_ones(arch, quant):
    model = load_model(tiny_checkpoint(arch, quant), dtype=torch.bfloat16, max_tokens=64)
    assert model.fused_layers == len(model.layers)
    fused, plain = fused_and_plain(model)
    for i, (a, b) in enumerate(zip(fused, plain, strict=True)):
        assert torch.equal(a, b), (arch, quant, i)


def test_expert_layers_run_unfused():
    model = load_model(tiny_checkpoint("qwen3_moe", "nvfp4"), dtype=torch.bfloat16, max_tokens=32)
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    assert model.fused_layers == 0 and all(layer.fused is None for layer in model.layers)


def test_float32_models_and_the_switch_leave_layers_unfused(monkeypatch):
    assert load_model(tiny_checkpoint("qwen2", "nvfp4"), dtype=torch.float32, max_tokens=32).fused_layers == 0
    monkeypatch.setenv("HETERO_RUN_FUSED_LAYERS", "0")
    assert load_model(tiny_checkpoint("qwen2", "nvfp4"), dtype=torch.bfloat16, max_tokens=32).fused_layers == 0


def test_a_fused_layer_rejects_a_wrong_hidden_state():
    model = load_model(tiny_checkpoint("llama", "nvfp4"), dtype=torch.bfloat16, max_tokens=32)
    layer = model.layers[0]
    h = torch.zeros(2, model.config.hidden_size + 1, dtype=torch.bfloat16)
    rows = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"h must be contiguous bf16 \[n, "):
        layer.fused.forward(h, h, h, rows, rows, torch.tensor([0, 1, 2]))


@pytest.mark.mpi
def test_fused_layers_give_the_bits_of_the_unfused_ones_at_tp2(tmp_path):
    path = tiny_checkpoint("qwen2", "nvfp4")
    proc = subprocess.run(mpirun_argv(2) + [sys.executable, str(JOB), str(path), str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env=env_for_tests({"PYTHONPATH": str(Path(__file__).parents[2])}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = torch.load(tmp_path / "rank0.pt")
    layers = load_model(path, dtype=torch.bfloat16, max_tokens=32).config.num_layers
    assert got["fused_layers"] == [layers, layers]
    for i, (a, b) in enumerate(zip(got["fused"], got["plain"], strict=True)):
        assert torch.equal(a, b), i
