"""Fast linear kernels (compiled CPU, GPU) against their plain-PyTorch references."""

import os
import subprocess
import sys

import pytest
import torch

from hetero_run.kernels import cpu_ext, nvfp4, nvfp4_gpu
from hetero_run.kernels.dense_linear import dense_linear, dense_linear_reference
from hetero_run.kernels.nvfp4_linear import nvfp4_dequantize, nvfp4_linear

needs_lib = pytest.mark.skipif(cpu_ext.ops() is None, reason="compiled CPU kernels unavailable here")
needs_amx = pytest.mark.skipif(not cpu_ext.features() & cpu_ext.FEATURE_AMX, reason="no AMX on this CPU")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# in_features exercising every code path: 128-chunks only, 32-element tails, a 16-element tail,
# and the real target's row-parallel o_proj (448 = 3 * 128 + 64).
SHAPES = [(37, 896), (64, 448), (5, 80), (16, 48), (3, 16), (130, 4864)]


def _weight(out, inp, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * torch.rand(out, 1, generator=gen)
    q = nvfp4.quantize(w)
    row_scale = q.global_scale * (1 + torch.rand(out, generator=gen))  # per-row, as after fusing
    return q.codes, q.block_scale, row_scale


def _close(y, ref, tol=2e-5):
    err = (y.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} vs max |ref| {scale:.3g}"


@needs_lib
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_nvfp4_linear_matches_reference(shape):
    codes, scale, row_scale = _weight(*shape)
    for n in (1, 2, 3, 5, 8, 9, 16):
        x = torch.randn(n, shape[1])
        ref = nvfp4.linear_reference(x, codes, scale, row_scale)
        _close(nvfp4_linear(x, codes, scale, row_scale), ref)
        y16 = nvfp4_linear(x.bfloat16(), codes, scale, row_scale)
        assert y16.dtype == torch.bfloat16
        _close(y16, nvfp4.linear_reference(x.bfloat16(), codes, scale, row_scale), tol=1e-2)


@needs_lib
def test_prefill_sized_batches_match():
    codes, scale, row_scale = _weight(300, 448)
    x = torch.randn(40, 448)
    _close(nvfp4_linear(x, codes, scale, row_scale), nvfp4.linear_reference(x, codes, scale, row_scale))
    xb = x.bfloat16()
    _close(nvfp4_linear(xb, codes, scale, row_scale), nvfp4.linear_reference(xb, codes, scale, row_scale), tol=1e-2)


@needs_amx
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % 32 == 0])
def test_amx_tiles_match_reference_for_bf16_activations(shape):
    """AMX: W dequantised exactly to bf16, products exact, fp32 sums: float32 results agree closely."""
    codes, scale, row_scale = _weight(*shape, seed=2)
    lib = cpu_ext.ops()
    w = nvfp4.dequantize(codes, scale, row_scale).bfloat16()
    for n in (1, 3, 8, 16):
        x = torch.randn(n, shape[1]).bfloat16()
        y = lib.nvfp4_linear(x, codes, scale.view(torch.uint8), row_scale, 2)
        _close(y, nvfp4.linear_reference(x, codes, scale, row_scale))
        _close(lib.dense_linear(x, w, 2), dense_linear_reference(x, w))
        _close(lib.nvfp4_linear(x, codes, scale.view(torch.uint8), row_scale, 1),
               nvfp4.linear_reference(x, codes, scale, row_scale))


@needs_lib
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_dequantize_is_bit_identical(shape):
    codes, scale, row_scale = _weight(*shape, seed=1)
    assert torch.equal(nvfp4_dequantize(codes, scale, row_scale), nvfp4.dequantize(codes, scale, row_scale))


def test_w4a4_quantises_activations_with_input_scale():
    codes, scale, row_scale = _weight(24, 64)
    x = torch.randn(3, 64)
    input_scale = float(x.abs().max()) / 2688
    w4a4 = nvfp4_linear(x, codes, scale, row_scale, input_scale=input_scale)
    ref = nvfp4.linear_reference(nvfp4.fake_quantize(x, input_scale), codes, scale, row_scale)
    _close(w4a4, ref)
    assert not torch.allclose(w4a4, nvfp4_linear(x, codes, scale, row_scale), rtol=1e-3)


@needs_lib
@pytest.mark.parametrize("shape", [(37, 896), (6, 80), (9, 40), (130, 4864)])
def test_compiled_dense_linear_matches_float64(shape):
    w = torch.randn(*shape)
    for wd, xd in [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)]:
        for n in (1, 4, 8, 11):
            x = torch.randn(n, shape[1]).to(xd)
            y = dense_linear(x, w.to(wd))
            assert y.dtype == xd
            _close(y, dense_linear_reference(x, w.to(wd)), tol=1e-2 if xd == torch.bfloat16 else 2e-5)


def test_without_compiled_kernels_the_pytorch_paths_give_the_same_results(tmp_path):
    """A library that fails to build is reported once and replaced by the PyTorch paths."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    code = (
        "import torch, logging, pathlib\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from hetero_run.kernels import cpu_ext, nvfp4\n"
        "from hetero_run.kernels.nvfp4_linear import nvfp4_linear\n"
        "from hetero_run.kernels.dense_linear import dense_linear\n"
        f"cpu_ext.SOURCES = [pathlib.Path({str(bad)!r})]\n"
        "assert cpu_ext.ops() is None and cpu_ext.features() == 0\n"
        "q = nvfp4.quantize(torch.randn(20, 64)); rs = q.global_scale.expand(20).contiguous()\n"
        "x = torch.randn(3, 64)\n"
        "ref = x @ nvfp4.dequantize(q.codes, q.block_scale, rs).T\n"
        "assert torch.allclose(nvfp4_linear(x, q.codes, q.block_scale, rs), ref, atol=1e-5)\n"
        "w = torch.randn(20, 64)\n"
        "assert torch.allclose(dense_linear(x, w), x @ w.T, atol=1e-5)\n"
        "print('fallback ok')\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
    assert proc.stderr.count("compiled CPU kernels unavailable") == 1


def test_a_library_built_from_these_sources_loads_without_the_build_machinery():
    if cpu_ext.ops() is None:
        pytest.skip("the compiled kernels do not build here")
    assert (cpu_ext.cache_dir() / f"{cpu_ext.NAME}.key").read_text() == cpu_ext.build_key()
    code = ("import sys; from hetero_run.kernels import cpu_ext\n"
            "assert cpu_ext.ops() is not None\n"
            "print('setuptools' in sys.modules, 'torch.utils.cpp_extension' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr


def test_disabled_by_environment(tmp_path):
    code = "from hetero_run.kernels import cpu_ext; print(cpu_ext.ops())"
    env = dict(os.environ, HETERO_RUN_CPU_KERNELS="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "None"


def _cublas_offset(r, c, col_tiles):
    """cuBLAS block-scaling layout, element by element: 512-byte tiles of 128 rows x 4 columns."""
    tile = (r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("shape", [(1, 4), (130, 7), (256, 8), (3, 56)])
def test_swizzled_scales_follow_the_cublas_layout(shape):
    scale = (torch.rand(shape) * 400 + 0.01).to(torch.float8_e4m3fn)
    ours = nvfp4_gpu.swizzle_block_scales(scale).view(torch.uint8)
    rows, cols = shape
    col_tiles = -(-cols // 4)
    assert ours.numel() == -(-rows // 128) * 128 * col_tiles * 4
    expected = torch.zeros_like(ours)
    raw = scale.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            expected[_cublas_offset(r, c, col_tiles)] = raw[r, c]
    assert torch.equal(ours, expected)


@needs_cuda
def test_gpu_weight_only_matches_cpu_reference():
    codes, scale, row_scale = _weight(200, 448)
    x = torch.randn(5, 448)
    ref = nvfp4.linear_reference(x, codes, scale, row_scale)
    dev = torch.device("cuda")
    y = nvfp4_linear(x.to(dev), codes.to(dev), scale.to(dev), row_scale.to(dev))
    _close(y.cpu(), ref)


@needs_cuda
def test_gpu_w4a4_matches_cpu_emulation():
    codes, scale, row_scale = _weight(256, 512)
    x = torch.randn(5, 512)
    input_scale = float(x.abs().max()) / 2688
    ref = nvfp4.linear_reference(nvfp4.fake_quantize(x, input_scale), codes, scale, row_scale)
    dev = torch.device("cuda")
    y = nvfp4_linear(x.to(dev, torch.bfloat16), codes.to(dev), scale.to(dev), row_scale.to(dev),
                     input_scale=input_scale, cache={})
    _close(y.float().cpu(), ref, tol=2e-2)  # bf16 activations and output
