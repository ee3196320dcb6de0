"""The NVFP4 reference against ModelOpt: NVFP4QTensor on random tensors, and export_hf_checkpoint."""

import pytest
import torch
from modelopt.torch.quantization.qtensor import NVFP4QTensor
from tiny_models import build_tiny_model, tiny_tokenizer

from hetero_run.kernels import nvfp4
from hetero_run.runtime.checkpoint import Checkpoint
from hetero_run.runtime.convert import save_converted


def _modelopt(w):
    qt, scale, gscale = NVFP4QTensor.quantize(w.clone(), 16)
    return qt, scale, gscale


def _assert_same_as_modelopt(w):
    qt, scale, gscale = _modelopt(w)
    ours = nvfp4.quantize(w)
    assert torch.equal(ours.codes, qt._quantized_data)
    assert torch.equal(ours.block_scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(ours.global_scale, gscale.float())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        theirs = qt.dequantize(dtype=dtype, scale=scale, double_scale=gscale, block_sizes={-1: 16})
        assert torch.equal(nvfp4.dequantize(ours.codes, ours.block_scale, ours.global_scale, dtype), theirs)
    return ours


def test_pack_puts_even_elements_in_the_low_nibble():
    codes = torch.tensor([[0xF, 0x2, 0x0, 0x8]], dtype=torch.uint8)
    packed = nvfp4.pack_e2m1(codes)
    assert packed.tolist() == [[0x2F, 0x80]]
    assert torch.equal(nvfp4.unpack_e2m1(packed), codes)
    every = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert torch.equal(nvfp4.pack_e2m1(nvfp4.unpack_e2m1(every)), every)


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.0, -0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 9.0, -0.3, -1.75, -100.0])
    expected = [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 9, 12, 15]
    assert nvfp4.e2m1_encode(x).tolist() == expected
    assert nvfp4.e2m1_decode(torch.tensor(expected, dtype=torch.uint8)).tolist() == [
        0, 0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 6, 6, -0.5, -2, -6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 64), (1, 16), (33, 48), (3, 5, 32)])
def test_random_tensors_match_modelopt_bit_for_bit(dtype, shape):
    gen = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    w = (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 3).to(dtype)
    _assert_same_as_modelopt(w)


def test_all_zero_blocks_get_scale_one_and_zero_codes():
    w = torch.randn(5, 64)
    w[1] = 0.0
    w[3, 16:32] = 0.0
    ours = _assert_same_as_modelopt(w)
    assert ours.block_scale[1].float().tolist() == [1.0] * 4
    assert ours.block_scale[3, 1].float().item() == 1.0
    assert ours.codes[1].eq(0).all() and ours.codes[3, 8:16].eq(0).all()


def test_blocks_whose_scale_underflows_clamp_to_the_smallest_fp8():
    w = torch.randn(3, 64) * 1e-7
    w[0, 0] = 1000.0  # global amax dominates: the other blocks' scales fall below 2^-9
    ours = _assert_same_as_modelopt(w)
    assert ours.block_scale[1].float().eq(2.0**-9).all()
    assert (ours.block_scale.float() > 0).all()


def test_a_given_global_scale_is_used_and_odd_scales_match():
    w = torch.randn(9, 32, dtype=torch.bfloat16)
    gscale = nvfp4.global_scale(w) * 1.7
    qt, scale, _ = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=gscale)
    ours = nvfp4.quantize(w, global_scale_=gscale)
    assert torch.equal(ours.codes, qt._quantized_data)
    assert torch.equal(ours.block_scale.view(torch.uint8), scale.view(torch.uint8))


def test_in_features_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.randn(4, 24))
    with pytest.raises(ValueError, match="blocks of 16"):
        nvfp4.quantize(torch.randn(4, 32), group_size=32)


def _linears(state: dict) -> dict[str, torch.Tensor]:
    """Unquantised weights by module name, MoE experts split as the checkpoint names them."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj"] = tensor[e, :half]
                out[f"{base}{e}.up_proj"] = tensor[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj"] = tensor[e]
        elif name.endswith("_proj.weight"):
            out[name.removesuffix(".weight")] = tensor
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_checkpoint_written_by_export_hf_checkpoint(arch, tmp_path):
    model = build_tiny_model(arch, seed=3)
    weights = _linears({k: v.detach().clone() for k, v in model.state_dict().items()})
    save_converted(model, tiny_tokenizer(), tmp_path / "ckpt", "nvfp4")
    ckpt = Checkpoint.open(tmp_path / "ckpt")
    assert ckpt.quant.algo == "NVFP4" and not ckpt.quant.quantizes("lm_head")
    assert len(weights) >= 14
    for module, w in weights.items():
        codes = ckpt.read(f"{module}.weight")
        scale = ckpt.read(f"{module}.weight_scale")
        gscale = ckpt.read(f"{module}.weight_scale_2")
        assert ckpt.read(f"{module}.input_scale") > 0
        # Fused groups (q/k/v, gate/up) share the largest of their global scales.
        assert gscale >= nvfp4.global_scale(w)
        if module.endswith(("o_proj", "down_proj")):
            assert torch.equal(gscale, nvfp4.global_scale(w)), module
        ours = nvfp4.quantize(w, global_scale_=gscale)
        assert torch.equal(ours.codes, codes), module
        assert torch.equal(ours.block_scale.view(torch.uint8), scale.view(torch.uint8)), module
        qt = NVFP4QTensor(tuple(w.shape), torch.bfloat16, codes)
        theirs = qt.dequantize(dtype=torch.bfloat16, scale=scale, double_scale=gscale, block_sizes={-1: 16})
        assert torch.equal(nvfp4.dequantize(codes, scale, gscale, torch.bfloat16), theirs), module
    for prefix in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"):
        assert torch.equal(ckpt.read(f"{prefix}.weight_scale_2"),
                           ckpt.read("model.layers.0.self_attn.v_proj.weight_scale_2"))
