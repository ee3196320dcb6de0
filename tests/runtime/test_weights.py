"""Linear-layer weights loaded from real ModelOpt / transformers checkpoints of tiny models."""

import io
import re

import pytest
import torch
from rich.console import Console
from tiny_models import ARCHITECTURES, tiny_checkpoint

from hetero_run.kernels import nvfp4
from hetero_run.runtime.checkpoint import Checkpoint, CheckpointError
from hetero_run.runtime.load_progress import load_progress
from hetero_run.runtime.weights import DenseWeight, NVFP4Weight, concat_out, load_linear

Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"
V = "model.layers.0.self_attn.v_proj"
O_PROJ = "model.layers.0.self_attn.o_proj"


def _close(y, ref, tol=2e-5):
    err = (y.double() - ref.double()).abs().max().item()
    assert err <= tol * ref.double().abs().max().item(), err


def test_nvfp4_linear_loads_packed_and_computes_x_wt():
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3", "nvfp4"))
    w = load_linear(ckpt, Q, shape=(64, 64))
    assert isinstance(w, NVFP4Weight) and (w.out_features, w.in_features) == (64, 64)
    expected = nvfp4.dequantize(ckpt.read(f"{Q}.weight"), ckpt.read(f"{Q}.weight_scale"),
                                ckpt.read(f"{Q}.weight_scale_2"))
    assert torch.equal(w.dequantize(), expected)
    assert w.nbytes == 64 * 32 + 64 * 4 + 64 * 4 + 64 * 4  # codes, block scales, row and input scales
    x = torch.randn(2, 3, 64)
    _close(w.matmul(x), x @ expected.T)
    assert w.matmul(x.bfloat16()).dtype == torch.bfloat16


def test_resident_bytes_per_parameter():
    w = NVFP4Weight.quantize(torch.randn(4864, 896))
    assert w.nbytes / (4864 * 896) == pytest.approx(0.5625 + 4 / 896)


def test_excluded_modules_stay_dense():
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3_moe", "nvfp4"))
    head = load_linear(ckpt, "lm_head", dtype=torch.float32)
    assert isinstance(head, DenseWeight) and head.weight.dtype == torch.float32
    assert torch.equal(head.weight, ckpt.read("lm_head.weight").float())
    router = load_linear(ckpt, "model.layers.1.mlp.gate")
    assert isinstance(router, DenseWeight) and router.out_features == 4
    assert isinstance(load_linear(ckpt, "model.layers.1.mlp.experts.3.down_proj"), NVFP4Weight)


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_column_and_row_parallel_parts_recombine(quant):
    ckpt = Checkpoint.open(tiny_checkpoint("qwen2", quant))
    x = torch.randn(3, 64)
    for prefix in (Q, "model.layers.1.mlp.gate_proj"):
        whole = load_linear(ckpt, prefix, dtype=torch.float32)
        parts = [load_linear(ckpt, prefix, (0, r, 2), torch.float32) for r in range(2)]
        assert parts[0].out_features == whole.out_features // 2
        _close(torch.cat([p.matmul(x) for p in parts], dim=-1), whole.matmul(x))
    for prefix, width in ((O_PROJ, 64), ("model.layers.1.mlp.down_proj", 128)):
        whole = load_linear(ckpt, prefix, dtype=torch.float32)
        xs = torch.randn(3, width)
        parts = [load_linear(ckpt, prefix, (1, r, 2), torch.float32) for r in range(2)]
        half = width // 2
        _close(parts[0].matmul(xs[:, :half]) + parts[1].matmul(xs[:, half:]), whole.matmul(xs), tol=1e-5)


def test_row_parallel_split_must_keep_whole_blocks():
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3", "nvfp4"))
    with pytest.raises(CheckpointError, match=r"64 inputs do not split into 8 parts of whole 16-element blocks"):
        load_linear(ckpt, O_PROJ, (1, 0, 8))
    with pytest.raises(CheckpointError, match="not divisible into 3 parts"):
        load_linear(ckpt, Q, (0, 0, 3))


def test_fused_qkv_keeps_each_parts_global_scale_exact():
    ckpt = Checkpoint.open(tiny_checkpoint("llama", "nvfp4"))
    parts = [load_linear(ckpt, p) for p in (Q, K, V)]
    # Different scales per part, as q/k/v of a checkpoint fused from separate exports would have.
    parts[1] = NVFP4Weight(parts[1].codes, parts[1].block_scale, parts[1].row_scale * 3, parts[1].input_scale * 2)
    fused = concat_out(parts)
    assert fused.out_features == 64 + 32 + 32
    x = torch.randn(4, 64)
    _close(fused.matmul(x), torch.cat([p.matmul(x) for p in parts], dim=-1))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    w4a4 = [NVFP4Weight(p.codes, p.block_scale, p.row_scale, p.input_scale, "w4a4") for p in parts]
    fused4 = concat_out(w4a4)
    assert len(fused4._input_scale_runs()) == 3
    _close(fused4.matmul(x), torch.cat([p.matmul(x) for p in w4a4], dim=-1))


def test_concat_out_refuses_mixed_formats_and_widths():
    a = NVFP4Weight.quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match="different formats"):
        concat_out([a, DenseWeight(torch.randn(8, 32))])
    with pytest.raises(ValueError, match="different in_features"):
        concat_out([a, NVFP4Weight.quantize(torch.randn(8, 64))])
    dense = concat_out([DenseWeight(torch.randn(8, 32)), DenseWeight(torch.randn(4, 32))])
    assert isinstance(dense, DenseWeight) and dense.out_features == 12


def test_w4a4_needs_an_input_scale():
    w = NVFP4Weight.quantize(torch.randn(8, 32), activation="w4a4")
    with pytest.raises(ValueError, match="needs input_scale"):
        w.matmul(torch.randn(1, 32))
    assert not NVFP4Weight.quantize(torch.randn(8, 32), input_scale=0.01).uses_w4a4(torch.device("cpu"))


def _tp_plan(name: str) -> int | None:
    """Split dimension of each tensor under Megatron-style TP (None: replicated)."""
    if re.search(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|weight_scale|bias)$", name):
        return 0
    if re.search(r"(o_proj|down_proj)\.(weight|weight_scale)$", name):
        return 1
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0  # vocabulary parallel
    return None


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_each_tp2_rank_reads_at_most_55_percent(arch, quant):
    path = tiny_checkpoint(arch, quant)
    for rank in range(2):
        ckpt = Checkpoint.open(path)
        seen = set()
        ckpt.on_read = lambda name, nbytes: seen.add(name)  # noqa: B023
        modules = sorted({n.rsplit(".", 1)[0] for n in ckpt.tensors if n.endswith("_proj.weight")})
        for module in modules:
            dim = _tp_plan(f"{module}.weight")
            load_linear(ckpt, module, (dim, rank, 2))
        for name in ckpt.tensors:
            if name not in seen:
                dim = _tp_plan(name)
                ckpt.read(name, dim=dim, part=None if dim is None else (rank, 2))
        assert seen == set(ckpt.tensors)  # everything the model needs was read
        assert ckpt.bytes_read <= 0.55 * ckpt.total_bytes, (rank, ckpt.bytes_read, ckpt.total_bytes)


def test_progress_counts_tensors_and_bytes():
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3", "nvfp4"))
    out = io.StringIO()
    with load_progress(ckpt, "loading tiny", console=Console(file=out, width=150)) as stats:
        for prefix in (Q, K, V, O_PROJ):
            load_linear(ckpt, prefix)
    assert stats.tensors == 16 and stats.bytes == ckpt.bytes_read > 0
    assert ckpt.on_read is None
    text = out.getvalue()
    assert "loading tiny" in text and "16 tensors" in text
