"""Rows do not depend on the batch: row i of f(x) equals f(x[i:i+1]) bit for bit, for every dtype
pair, NVFP4, every compiled path and the PyTorch fallback. With the compiled kernels this holds
for any number of rows (a batching engine mixes many requests' rows and prefill chunks in one
forward); the fallback keeps it up to VERIFY_MAX_ROWS rows."""

import pytest
import torch
from kernel_support import forced_dense_streaming

from hetero_run.kernels import batch_invariance, cpu_ext, nvfp4
from hetero_run.kernels.batch_invariance import VERIFY_MAX_ROWS, linear_rows_invariant, per_row
from hetero_run.kernels.dense_linear import dense_linear
from hetero_run.kernels.nvfp4_linear import nvfp4_linear

FALLBACK_ROWS = (2, 3, 8, 9, 16, 17, 25, VERIFY_MAX_ROWS)
COMPILED_ROWS = (2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 25, VERIFY_MAX_ROWS, 33, 64, 130)
# in % 32 == 0 and not (NVFP4 needs in % 16 == 0); 1040 inputs: x no longer fits in half of L1
# from a few rows on, and the dense kernel reads weight rows four at a time (26: and one by one);
# 75 x 896: up to 16 rows of x staged against pairs of weight rows, each thread's range of odd
# length (its last row alone)
SHAPES = [(96, 256), (72, 80), (40, 112), (26, 1040), (75, 896)]
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.float32)]


def _row_by_row_equal(f, x: torch.Tensor) -> list[int]:
    """Rows of f(x) that differ from f of that row alone."""
    y = f(x)
    return [i for i in range(x.shape[0]) if not torch.equal(y[i:i + 1], f(x[i:i + 1]))]


def _rows(library) -> tuple[int, ...]:
    return COMPILED_ROWS if library == "compiled" else FALLBACK_ROWS


@pytest.mark.parametrize("x_dtype, w_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("out, inp", SHAPES)
def test_dense_rows_do_not_depend_on_the_batch(library, x_dtype, w_dtype, out, inp):
    g = torch.Generator().manual_seed(out + inp)
    w = torch.randn(out, inp, generator=g).to(w_dtype)
    for n in _rows(library):
        x = torch.randn(n, inp, generator=g).to(x_dtype)
        assert _row_by_row_equal(lambda rows: dense_linear(rows, w), x) == [], n


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("out, inp", SHAPES)
def test_nvfp4_rows_do_not_depend_on_the_batch(library, x_dtype, out, inp):
    g = torch.Generator().manual_seed(out * inp)
    q = nvfp4.quantize(torch.randn(out, inp, generator=g))
    row_scale = q.global_scale.expand(out).contiguous()
    for n in _rows(library):
        x = torch.randn(n, inp, generator=g).to(x_dtype)
        assert _row_by_row_equal(lambda rows: nvfp4_linear(rows, q.codes, q.block_scale, row_scale), x) == [], n


def _skip_amx_unless_tiles_fit(isa, in_features: int) -> None:
    # the layers pick the AMX path only then (nvfp4.md, the kernel table); the op refuses the rest
    if isa.name == "amx" and in_features % 32:
        pytest.skip("AMX tiles need in_features a multiple of 32")


@pytest.mark.parametrize("inp", [256, 896, 4864, 80, 448])
def test_each_compiled_path_is_batch_invariant(isa, inp):
    """Every path the CPU runs, forced, at every row count (few rows decode in registers: up to 4
    with AVX-512, 6 with AVX2; more through tiles in one, two or three groups per weight pass,
    prefill-sized in several passes): the same bits as each row alone."""
    _skip_amx_unless_tiles_fit(isa, inp)
    lib = cpu_ext.ops()
    g = torch.Generator().manual_seed(inp)
    out = 40
    w = torch.randn(out, inp, generator=g)
    q = nvfp4.quantize(w)
    scales, row_scale = q.block_scale.view(torch.uint8), q.global_scale.expand(out).contiguous()
    for dtype in [torch.bfloat16] if isa.bf16_only else [torch.bfloat16, torch.float32]:
        x = torch.randn(70, inp, generator=g).to(dtype)
        wd = w.to(dtype)
        for n in (2, 4, 5, 6, 7, 17, 24, 40, 70):
            rows = x[:n]
            assert _row_by_row_equal(lambda r: lib.nvfp4_linear(r, q.codes, scales, row_scale, isa.path), rows) == []
            assert _row_by_row_equal(lambda r, wd=wd: lib.dense_linear(r, wd, isa.path), rows) == []
        # a row keeps its bits whichever rows come with it
        mixed = torch.cat([x[3:4], torch.randn(9, inp, generator=g).to(dtype)])
        assert torch.equal(lib.nvfp4_linear(mixed, q.codes, scales, row_scale, isa.path)[0],
                           lib.nvfp4_linear(x[:20], q.codes, scales, row_scale, isa.path)[3])


@pytest.mark.parametrize("out, inp", [(75, 896), (96, 256), (26, 1040)])
def test_every_dense_streaming_way_gives_the_same_bits(isa, out, inp):
    """The three ways the AVX-512 dense kernel streams few rows (chosen by the CPU) run the same
    sums in the same order: every row count gives the same bits each way, and the same bits as
    each row alone."""
    _skip_amx_unless_tiles_fit(isa, inp)
    lib = cpu_ext.ops()
    g = torch.Generator().manual_seed(out + inp)
    w = torch.randn(out, inp, generator=g)
    for dtype in [torch.bfloat16] if isa.bf16_only else [torch.bfloat16, torch.float32]:
        wd = w.to(dtype)
        x = torch.randn(17, inp, generator=g).to(dtype)
        for n in (1, 2, 5, 8, 9, 16, 17):
            ys = []
            for mode in (0, 1, 2):
                with forced_dense_streaming(lib, mode):
                    ys.append(lib.dense_linear(x[:n], wd, isa.path))
                    assert _row_by_row_equal(lambda r, wd=wd: lib.dense_linear(r, wd, isa.path), x[:n]) == [], (mode, n)
            assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2]), (dtype, n)
    with pytest.raises(RuntimeError, match="dense streaming mode must be -1, 0, 1 or 2, got 3"):
        lib.set_dense_streaming(3)


def test_prefill_sized_forwards_are_row_invariant_with_the_library():
    if cpu_ext.ops() is None:
        pytest.skip("the compiled kernels do not build here")
    g = torch.Generator().manual_seed(5)
    q = nvfp4.quantize(torch.randn(64, 896, generator=g))
    row_scale = q.global_scale.expand(64).contiguous()
    w = torch.randn(64, 896, generator=g).bfloat16()
    x = torch.randn(600, 896, generator=g).bfloat16()  # above VERIFY_MAX_ROWS and a pass of x rows
    ref_q = torch.cat([nvfp4_linear(x[i:i + 1], q.codes, q.block_scale, row_scale) for i in range(0, 600, 37)])
    ref_d = torch.cat([dense_linear(x[i:i + 1], w) for i in range(0, 600, 37)])
    assert torch.equal(nvfp4_linear(x, q.codes, q.block_scale, row_scale)[::37], ref_q)
    assert torch.equal(dense_linear(x, w)[::37], ref_d)


def test_linear_rows_invariant_says_where(monkeypatch):
    assert linear_rows_invariant("cpu") == (cpu_ext.ops() is not None)
    assert not linear_rows_invariant("cuda")
    monkeypatch.setitem(cpu_ext._state, "ops", None)
    assert not linear_rows_invariant("cpu")
    assert batch_invariance.invariant(VERIFY_MAX_ROWS) and not batch_invariance.invariant(VERIFY_MAX_ROWS + 1)


def test_the_check_sees_batch_dependent_rows():
    # A product whose summation order follows the number of rows (as a GEMM that picks its
    # blocking by shape does): float32 sums of many terms, re-associated per batch size.
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 4096, generator=g), torch.randn(8, 4096, generator=g)

    def by_shape(rows):
        chunks = rows.shape[0] * 64  # the batch size picks the blocking of the inner dimension
        return sum((rows[:, k:k + chunks] @ w[:, k:k + chunks].T for k in range(0, 4096, chunks)), torch.zeros(()))

    assert _row_by_row_equal(by_shape, x) != []


def test_per_row_applies_the_function_to_each_row():
    x = torch.arange(12.0).view(4, 3)
    assert torch.equal(per_row(lambda r: r.sum(dim=1, keepdim=True) * r.shape[0], x), x.sum(dim=1, keepdim=True))
