"""Fast linear kernels (compiled CPU, GPU) against their plain-PyTorch references."""

import os
import subprocess
import sys

import pytest
import torch

from hetero_run.kernels import cpu_ext, cpu_isa, nvfp4, nvfp4_gpu
from hetero_run.kernels.dense_linear import dense_linear, dense_linear_reference
from hetero_run.kernels.nvfp4_linear import (
    linear_i8_reference,
    nvfp4_dequantize,
    nvfp4_linear,
    nvfp4_linear_i8,
    quantize_i8_reference,
)

needs_lib = pytest.mark.skipif(cpu_ext.ops() is None, reason="compiled CPU kernels unavailable here")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# in_features exercising every code path: whole groups of 16 blocks (256 inputs), a last group
# of 9-15 blocks (384, 448 = the real target's row-parallel o_proj, 4864 = its down_proj minus
# nothing: 19 groups), a last group of 1-8 blocks (16, 48, 80, 144, 896 = 3.5 groups), one block.
SHAPES = [(37, 896), (64, 448), (5, 80), (16, 48), (3, 16), (130, 4864), (19, 256), (23, 384), (9, 144)]
ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 40)  # every blocking of the AVX-512 kernels; the tiles of AMX and AVX2


def _weight(out, inp, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * torch.rand(out, 1, generator=gen)
    w[0, :16] = 0  # an all-zero block (scale 1.0)
    if out > 1:
        w[1, : min(inp, 48)] *= 1e-6  # blocks whose fp8 scales are subnormal
    q = nvfp4.quantize(w)
    row_scale = q.global_scale * (1 + torch.rand(out, generator=gen))  # per-row, as after fusing
    return q.codes, q.block_scale, row_scale


def _close(y, ref, tol=2e-5):
    err = (y.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} vs max |ref| {scale:.3g}"


def _x_dtypes(isa):
    return [torch.bfloat16] if isa.bf16_only else [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("shape", SHAPES)
def test_each_nvfp4_path_matches_reference(isa, shape):
    """Every instruction set's kernel (forced) against the plain-PyTorch reference, for bf16 and
    float32 activations, at every row count's blocking."""
    if isa.name == "amx" and shape[1] % 32:
        pytest.skip("AMX tiles need in_features a multiple of 32")
    codes, scale, row_scale = _weight(*shape)
    lib = cpu_ext.ops()
    for dtype in _x_dtypes(isa):
        for n in ROWS:
            x = torch.randn(n, shape[1]).to(dtype)
            y = lib.nvfp4_linear(x, codes, scale.view(torch.uint8), row_scale, isa.path)
            _close(y, nvfp4.linear_reference(x, codes, scale, row_scale))


def test_bf16_out_is_torch_rounding_of_the_float32_result(isa):
    """`bf16_out` (what the runtime asks for bf16 activations) rounds y in the op: the bits of
    torch's .to(bfloat16) of the float32 result, on every path, for both ops, at sizes with and
    without a remainder of 16 elements, including values that round up to the next binade, to
    infinity, and ties."""
    codes, scale, row_scale = _weight(151, 896, seed=5)
    lib = cpu_ext.ops()
    for dtype in _x_dtypes(isa):
        for n in (1, 3, 17):
            x = torch.randn(n, 896).to(dtype)
            want = lib.nvfp4_linear(x, codes, scale.view(torch.uint8), row_scale, isa.path)
            got = lib.nvfp4_linear(x, codes, scale.view(torch.uint8), row_scale, isa.path, True)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16)), (dtype, n)
            w = torch.randn(151, 896).to(dtype)
            if isa.name == "amx" or w.dtype == x.dtype:
                want = lib.dense_linear(x, w, isa.path)
                assert torch.equal(lib.dense_linear(x, w, isa.path, True), want.to(torch.bfloat16)), (dtype, n)
    # rounding itself: a weight row of ones against x = the values to round (one product each)
    values = torch.tensor([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1.99999, 3.3999e38, -2.5e-40, 0.0, 7e-45, -3.0] * 3)
    w = torch.zeros(values.numel(), 16)
    w[:, 0] = values
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    for isa_path in ([isa.path] if not isa.bf16_only else []):
        want = lib.dense_linear(x, w, isa_path)
        assert torch.equal(want[0], values)
        got = lib.dense_linear(x, w, isa_path, True)
        assert torch.equal(got.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)), got
        assert got[0, 4].item() == float("inf") and got[0, 1].item() == 1.0 and got[0, 2].item() == 1 + 2 ** -6


def test_round_bf16_in_place_is_torch_rounding_held_in_float32(width):
    """round_bf16_ leaves in a float32 tensor what .to(bfloat16).float() gives (ties, the next
    binade, infinity, subnormals, NaN), over lengths with and without a remainder of 8 or 16 and
    across the threads' chunks, at every vector width; and bf16_out rounds alike."""
    lib = cpu_ext.ops()
    special = torch.tensor([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1.99999, 3.3999e38, -2.5e-40, 0.0, -0.0, 7e-45,
                            -3.0, float("inf"), -float("inf")])
    for numel in (1, 12, 17, 1000, 3 * 65536 + 5):
        y = torch.randn(numel) * 10.0 ** torch.randint(-30, 30, (numel,)).float()
        y[:min(numel, special.numel())] = special[:numel]
        want = y.to(torch.bfloat16).float()
        got = lib.round_bf16_(y)
        assert got.data_ptr() == y.data_ptr() and torch.equal(got.view(torch.int32), want.view(torch.int32)), numel
    nan = torch.tensor([float("nan")])
    assert lib.round_bf16_(nan).isnan().all()
    y = torch.randn(65536 + 13) * 10.0 ** torch.randint(-30, 30, (65536 + 13,)).float()
    y[:special.numel()] = special
    y[7] = 5.0  # -0.0 would come out +0.0: the sums start from +0
    got = lib.dense_linear(torch.ones(1, 1), y[:, None], 0, True)  # one product each: y itself
    assert torch.equal(got[0].view(torch.int16), y.to(torch.bfloat16).view(torch.int16))


def test_float_out_holds_the_bf16_result_in_float32(library):
    """dense_linear(..., float_out=True) is dense_linear(...).float() bit for bit (what the LM
    head returns), with the compiled kernels and without, for bf16 and float32 activations."""
    g = torch.Generator().manual_seed(11)
    for x_dtype, w_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                             (torch.float32, torch.bfloat16)):
        w = torch.randn(300, 896, generator=g).to(w_dtype)
        for n in (1, 5, 40):
            x = torch.randn(n, 896, generator=g).to(x_dtype)
            got = dense_linear(x, w, float_out=True)
            assert got.dtype == torch.float32 and torch.equal(got, dense_linear(x, w).float()), (x_dtype, n)


def test_block_scales_of_every_kind_decode_exactly(isa):
    """Negative, subnormal and zero fp8 block scales (which the fast scale conversion leaves to
    the exact one) next to ordinary ones."""
    codes, scale, row_scale = _weight(8, 512, seed=3)
    raw = scale.view(torch.uint8).clone()
    raw[0, 3] |= 0x80  # negative
    raw[2, 5] = 0x03  # subnormal
    raw[3, 17] = 0x00  # zero
    raw[4, 31] = 0x80  # negative zero
    lib = cpu_ext.ops()
    for dtype in _x_dtypes(isa):
        for n in (1, 7):
            x = torch.randn(n, 512).to(dtype)
            ref = nvfp4.linear_reference(x, codes, raw.view(torch.float8_e4m3fn), row_scale)
            _close(lib.nvfp4_linear(x, codes, raw, row_scale, isa.path), ref)


def test_block_scales_decode_exactly_where_denormals_are_flushed(isa):
    """The fast scale conversion passes subnormal e4m3 scales through a float32 denormal; a thread
    that flushes denormals (torch.set_flush_denormal) must still get their exact value."""
    codes, scale, row_scale = _weight(8, 512, seed=4)
    raw = torch.randint(1, 8, scale.shape, dtype=torch.uint8)  # every scale subnormal: m * 2^-9
    lib = cpu_ext.ops()
    x = torch.randn(3, 512)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for dtype in _x_dtypes(isa):
            xs = x.to(dtype)
            ref = nvfp4.linear_reference(xs, codes, raw.view(torch.float8_e4m3fn), row_scale)
            _close(lib.nvfp4_linear(xs, codes, raw, row_scale, isa.path), ref)
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("shape", [(37, 896), (6, 80), (9, 40), (130, 4864), (33, 97)])
def test_each_dense_path_matches_float64(isa, shape, dense_streaming):
    if isa.name == "amx" and shape[1] % 32:
        pytest.skip("AMX tiles need in_features a multiple of 32")
    lib = cpu_ext.ops()
    w = torch.randn(*shape)
    for xd in _x_dtypes(isa):
        for wd in ([torch.bfloat16] if xd == torch.bfloat16 or isa.bf16_only else [torch.bfloat16, torch.float32]):
            for n in (1, 4, 8, 11, 40):
                x = torch.randn(n, shape[1]).to(xd)
                _close(lib.dense_linear(x, w.to(wd), isa.path), dense_linear_reference(x, w.to(wd)), tol=2e-5)


def test_a_path_the_cpu_lacks_is_refused():
    lib = cpu_ext.ops()
    if lib is None:
        pytest.skip("the compiled kernels do not build here")
    codes, scale, row_scale = _weight(4, 64)
    missing = [isa for isa in cpu_isa.ISAS if isa.feature and not cpu_ext.supported_features() & isa.feature]
    for isa in missing:
        with pytest.raises(RuntimeError, match="cannot run"):
            lib.nvfp4_linear(torch.randn(2, 64).bfloat16(), codes, scale.view(torch.uint8), row_scale, isa.path)
    with pytest.raises(RuntimeError, match="bfloat16"):
        lib.dense_linear(torch.randn(2, 64), torch.randn(4, 64), 3)  # AVX512-BF16 path, float32 x
    with pytest.raises(RuntimeError, match="path must be"):
        lib.dense_linear(torch.randn(2, 64), torch.randn(4, 64), 7)



def test_error_messages_are_built_without_iostreams():
    """TORCH_CHECK formats numbers through an ostream inserter instantiated in this library, which
    crashed a process whose C++ runtime was older than the compiler's headers (csrc/check.h)."""
    streams = ("TORCH_CHECK(", "c10::str(", "ostream", "std::cout", "std::cerr", "TORCH_WARN", "AT_ERROR(")
    found = [f"{path.name}:{number}: {line.strip()}"
             for path in sorted(cpu_ext.CSRC.iterdir()) if path.suffix in (".cpp", ".h") and path.name != "check.h"
             for number, line in enumerate(path.read_text().splitlines(), 1) if any(s in line for s in streams)]
    assert found == []
    lib = cpu_ext.ops()
    if lib is None:
        pytest.skip("the compiled kernels do not build here")
    with pytest.raises(RuntimeError, match=r"^path must be 0\.\.6, got -1$"):
        lib.dense_linear(torch.randn(2, 64), torch.randn(4, 64), -1)
    with pytest.raises(RuntimeError, match=r"^w has 32 inputs, x has 64$"):
        lib.dense_linear(torch.randn(2, 64), torch.randn(4, 32), 0)

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
@pytest.mark.parametrize("n", [40, 130, 300])
def test_prefill_sized_batches_match(n):
    """Prefill chunks take the same kernel, in passes of x rows that fit L2."""
    codes, scale, row_scale = _weight(70, 4864)
    x = torch.randn(n, 4864)
    _close(nvfp4_linear(x, codes, scale, row_scale), nvfp4.linear_reference(x, codes, scale, row_scale))
    xb = x.bfloat16()
    _close(nvfp4_linear(xb, codes, scale, row_scale), nvfp4.linear_reference(xb, codes, scale, row_scale), tol=1e-2)
    w = torch.randn(70, 4864)
    _close(dense_linear(x, w), dense_linear_reference(x, w))


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


# The CUDA module's functions take CPU tensors too (weight-only, and W4A4 emulated as on GPUs
# without FP4 tensor cores), so CI checks their arithmetic; a CUDA machine checks it there.
GPU_MODULE_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", GPU_MODULE_DEVICES)
def test_gpu_weight_only_matches_cpu_reference(device):
    codes, scale, row_scale = _weight(200, 448)
    x = torch.randn(5, 448)
    ref = nvfp4.linear_reference(x, codes, scale, row_scale)
    dev = torch.device(device)
    y = nvfp4_gpu.linear_weight_only(x.to(dev), codes.to(dev), scale.to(dev), row_scale.to(dev))
    _close(y.cpu(), ref)


@pytest.mark.parametrize("device", GPU_MODULE_DEVICES)
def test_gpu_w4a4_matches_cpu_emulation(device):
    codes, scale, row_scale = _weight(256, 512)
    # bf16 values, so both sides quantise the same activations (a value rounded to bf16 first can
    # land on the other side of an FP4 rounding boundary: one step of a block's scale)
    x = torch.randn(5, 512).bfloat16().float()
    input_scale = float(x.abs().max()) / 2688
    ref = nvfp4.linear_reference(nvfp4.fake_quantize(x, input_scale), codes, scale, row_scale)
    dev = torch.device(device)
    y = nvfp4_gpu.linear_w4a4(x.to(dev, torch.bfloat16), codes.to(dev), scale.to(dev), row_scale.to(dev),
                              input_scale=input_scale, cache={})
    assert y.dtype == torch.bfloat16
    _close(y.float().cpu(), ref, tol=1e-2)  # bf16 output


@needs_cuda
def test_cuda_tensors_take_the_cuda_functions():
    codes, scale, row_scale = _weight(64, 256)
    x = torch.randn(3, 256)
    dev = torch.device("cuda")
    args = (codes.to(dev), scale.to(dev), row_scale.to(dev))
    assert torch.equal(nvfp4_linear(x.to(dev), *args), nvfp4_gpu.linear_weight_only(x.to(dev), *args))


# ---------------------------------------------------------------- int8 activations (the drafter's kernel)

I8_PATHS = {"avx2": 5, "portable": 6}


def _i8_path(name: str) -> int:
    lib = cpu_ext.ops()
    if lib is None:
        pytest.skip("the compiled kernels do not build here")
    if name == "avx2" and not lib.cpu_supported_features() & cpu_ext.FEATURE_AVX2:
        pytest.skip("this CPU has no AVX2 (CPUID / OS)")
    return I8_PATHS[name]


def _unpack_i8(xq: torch.Tensor, n: int, inp: int):
    """A quantised row (csrc/nvfp4_int8.cpp's layout) -> q int8 [n, inp], corr int32 [n, groups, 8],
    lane scales float32 [n, groups, 8]."""
    g = xq.view(n, -1, 128)
    q = torch.stack([g[..., :32], g[..., 32:64]], dim=-1).reshape(n, -1).view(torch.int8)[:, :inp]
    return q, g[..., 64:96].contiguous().view(torch.int32), g[..., 96:].contiguous().view(torch.float32)


@pytest.mark.parametrize("path", list(I8_PATHS))
@pytest.mark.parametrize("inp", [16, 48, 64, 80, 576, 1536])
def test_int8_quantisation_is_the_reference_one(path, inp):
    """Each block of 16 quantised with its own scale, rounded to even, zero blocks and the zero
    padding of a last partial group included; the offsets' sums and the lane scales beside it."""
    p = _i8_path(path)
    lib = cpu_ext.ops()
    g = torch.Generator().manual_seed(inp)
    x = torch.randn(3, inp, generator=g) * torch.logspace(-3, 3, inp)  # blocks of very different sizes
    x[0, :16] = 0
    x[1, :8] = torch.tensor([2.5, -2.5, 0.5, 1.5, 127.0, -127.0, 63.5, 0.0])  # ties at the scale 1
    x[1, 8:16] = 0
    x[1, 4] = 127.0
    q, corr, lanes = _unpack_i8(lib.nvfp4_i8_quantize(x, p), 3, inp)
    want_q, want_a = quantize_i8_reference(x)
    assert torch.equal(q, want_q)
    groups = -(-inp // 64)
    padded = torch.zeros(3, groups * 64, dtype=torch.int32)
    padded[:, :inp] = want_q.int()
    assert torch.equal(corr, 12 * padded.view(3, groups, 8, 8).sum(-1))
    a = torch.zeros(3, groups * 4)
    a[:, :inp // 16] = want_a
    assert torch.equal(lanes, a.view(3, groups, 4).repeat_interleave(2, dim=-1))


@pytest.mark.parametrize("shape", SHAPES + [(50, 576), (21, 1536)])
def test_int8_paths_give_the_same_bits_for_every_row_alone(shape):
    """The AVX2 kernel and the portable loops: one set of bits, each row as it is alone, and
    within float32 rounding of the same sums in float64 from the same quantised activations."""
    if cpu_ext.ops() is None:
        pytest.skip("the compiled kernels do not build here")
    lib = cpu_ext.ops()
    codes, scale, row_scale = _weight(*shape)
    raw = scale.view(torch.uint8)
    x = torch.randn(17, shape[1]) * 4
    portable = lib.nvfp4_linear_i8(x, codes, raw, row_scale, 6)
    _close(portable, linear_i8_reference(x, codes, scale, row_scale))
    assert torch.equal(nvfp4_linear_i8(x, codes, scale, row_scale), lib.nvfp4_linear_i8(x, codes, raw, row_scale, 0))
    if not lib.cpu_supported_features() & cpu_ext.FEATURE_AVX2:
        return
    avx2 = lib.nvfp4_linear_i8(x, codes, raw, row_scale, 5)
    assert torch.equal(avx2, portable)
    for n in (1, 2, 3, 4, 5, 9):
        assert torch.equal(lib.nvfp4_linear_i8(x[:n], codes, raw, row_scale, 5), avx2[:n]), n
    for i in (0, 6, 16):
        assert torch.equal(lib.nvfp4_linear_i8(x[i:i + 1], codes, raw, row_scale, 5), avx2[i:i + 1]), i


@pytest.mark.parametrize("path", list(I8_PATHS))
def test_int8_kernels_take_scales_of_every_kind_with_denormals_flushed(path):
    """Negative, zero and subnormal block scales (exact as integers, no float denormal), in rows
    beside ordinary ones, also on a thread that flushes denormals."""
    p = _i8_path(path)
    lib = cpu_ext.ops()
    codes, scale, row_scale = _weight(8, 512, seed=3)
    raw = scale.view(torch.uint8).clone()
    raw[0, 3] |= 0x80
    raw[2, 5] = 0x03
    raw[3, 17] = 0x00
    raw[4, 31] = 0x80
    raw[5] = torch.randint(1, 8, (32,), dtype=torch.uint8)  # every scale subnormal
    x = torch.randn(3, 512)
    want = linear_i8_reference(x, codes, raw.view(torch.float8_e4m3fn), row_scale)
    _close(lib.nvfp4_linear_i8(x, codes, raw, row_scale, p), want)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        _close(lib.nvfp4_linear_i8(x, codes, raw, row_scale, p), want)
    finally:
        torch.set_flush_denormal(False)


def test_int8_activations_stay_close_to_the_float_kernels():
    """What the drafter gives up: int8 rounding of each block, a fraction of a percent of the
    largest output here."""
    codes, scale, row_scale = _weight(64, 576, seed=2)
    x = torch.randn(4, 576)
    err = (nvfp4_linear_i8(x, codes, scale, row_scale) - nvfp4.linear_reference(x, codes, scale, row_scale)).abs()
    assert err.max() <= 0.02 * nvfp4.linear_reference(x, codes, scale, row_scale).abs().max()


def test_int8_kernels_refuse_what_they_cannot_take():
    lib = cpu_ext.ops()
    if lib is None:
        pytest.skip("the compiled kernels do not build here")
    codes, scale, row_scale = _weight(4, 64)
    raw = scale.view(torch.uint8)
    with pytest.raises(RuntimeError, match="x must be float32"):
        lib.nvfp4_linear_i8(torch.randn(2, 64).bfloat16(), codes, raw, row_scale, 0)
    with pytest.raises(RuntimeError, match="take path 0, 5 .AVX2. or 6 .portable., got 3"):
        lib.nvfp4_linear_i8(torch.randn(2, 64), codes, raw, row_scale, 3)
    with pytest.raises(RuntimeError, match="codes have 64 inputs, x has 32"):
        lib.nvfp4_linear_i8(torch.randn(2, 32), codes, raw, row_scale, 0)
