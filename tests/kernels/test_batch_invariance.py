"""The linear kernels are batch-invariant up to VERIFY_MAX_ROWS rows: row i of f(x) equals
f(x[i:i+1]) bit for bit, for every dtype pair, NVFP4, each compiled path and the PyTorch fallback."""

import pytest
import torch

from hetero_run.kernels import cpu_ext, nvfp4
from hetero_run.kernels.batch_invariance import VERIFY_MAX_ROWS, per_row
from hetero_run.kernels.dense_linear import dense_linear
from hetero_run.kernels.nvfp4_linear import nvfp4_linear

ROWS = (2, 3, 8, 9, 16, 17, 25, VERIFY_MAX_ROWS)
# in % 32 == 0 and not (NVFP4 needs in % 16 == 0); 1040 inputs: x no longer fits in half of L1
# from a few rows on, and the dense kernel reads weight rows four at a time (26: and one by one)
SHAPES = [(96, 256), (72, 80), (40, 112), (26, 1040)]
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.float32)]


def _row_by_row_equal(f, x: torch.Tensor) -> list[int]:
    """Rows of f(x) that differ from f of that row alone."""
    y = f(x)
    return [i for i in range(x.shape[0]) if not torch.equal(y[i:i + 1], f(x[i:i + 1]))]


@pytest.mark.parametrize("x_dtype, w_dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("out, inp", SHAPES)
def test_dense_rows_do_not_depend_on_the_batch(library, x_dtype, w_dtype, out, inp):
    g = torch.Generator().manual_seed(out + inp)
    w = torch.randn(out, inp, generator=g).to(w_dtype)
    for n in ROWS:
        x = torch.randn(n, inp, generator=g).to(x_dtype)
        assert _row_by_row_equal(lambda rows: dense_linear(rows, w), x) == [], n


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("out, inp", SHAPES)
def test_nvfp4_rows_do_not_depend_on_the_batch(library, x_dtype, out, inp):
    g = torch.Generator().manual_seed(out * inp)
    q = nvfp4.quantize(torch.randn(out, inp, generator=g))
    row_scale = q.global_scale.expand(out).contiguous()
    for n in ROWS:
        x = torch.randn(n, inp, generator=g).to(x_dtype)
        assert _row_by_row_equal(lambda rows: nvfp4_linear(rows, q.codes, q.block_scale, row_scale), x) == [], n


@pytest.mark.parametrize("path", [1, 2], ids=["vector", "amx"])
def test_each_compiled_path_is_batch_invariant(path):
    lib = cpu_ext.ops()
    if lib is None or (path == 2 and not cpu_ext.features() & cpu_ext.FEATURE_AMX):
        pytest.skip("needs the compiled kernels" + (" and AMX" if path == 2 else ""))
    g = torch.Generator().manual_seed(path)
    w = torch.randn(80, 384, generator=g).bfloat16()
    q = nvfp4.quantize(w.float())
    scales, row_scale = q.block_scale.view(torch.uint8), q.global_scale.expand(80).contiguous()
    x = torch.randn(VERIFY_MAX_ROWS + 7, 384, generator=g).bfloat16()
    assert _row_by_row_equal(lambda rows: lib.dense_linear(rows, w, path), x) == []
    assert _row_by_row_equal(lambda rows: lib.nvfp4_linear(rows, q.codes, scales, row_scale, path), x) == []


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
