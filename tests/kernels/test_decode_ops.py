"""Attention over the KV cache and RMS norm (kernels/decode_ops.py): the compiled kernels against
float64 references and PyTorch, and row i of an n-row call equal bit for bit to that row alone."""

import math

import pytest
import torch

from hetero_run.kernels import cpu_ext
from hetero_run.kernels.decode_ops import decode_attention, decode_attention_reference, rms_norm


def _attention_float64(q, k, v, start, scale):
    """Row i over slots 0 .. start + i, query head h on KV head h // group, in float64."""
    n, heads, _ = q.shape
    group = heads // k.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        for h in range(heads):
            keys, values = k[h // group, :start + i + 1].double(), v[h // group, :start + i + 1].double()
            p = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ values
    return out


def _cache(kv_heads, slots, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(2, 3, kv_heads, slots, d, generator=g).to(dtype)  # [k|v, layer, ...]: a layer's view
    return full[0, 1], full[1, 1]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, d", [(14, 2, 64), (8, 8, 128), (4, 2, 40)])
def test_attention_matches_float64(library, dtype, tol, heads, kv_heads, d):
    k, v = _cache(kv_heads, 90, d, dtype, seed=d)
    q = torch.randn(5, heads, d, generator=torch.Generator().manual_seed(heads)).to(dtype)
    got = decode_attention(q, k, v, 37, 1 / math.sqrt(d))
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), _attention_float64(q, k, v, 37, 1 / math.sqrt(d)), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 40])
def test_attention_rows_do_not_depend_on_the_batch(library, dtype, d):
    k, v = _cache(2, 200, d, dtype, seed=3)
    q = torch.randn(25, 14, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    together = decode_attention(q, k, v, 100, 0.125)
    for i in range(q.shape[0]):
        alone = decode_attention(q[i:i + 1], k, v, 100 + i, 0.125)
        assert torch.equal(together[i:i + 1], alone), i


def test_compiled_attention_matches_pytorch_one_row_at_a_time():
    if cpu_ext.ops() is None:
        pytest.skip("the compiled kernels do not build here")
    k, v = _cache(2, 300, 64, torch.float32, seed=5)
    q = torch.randn(3, 14, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(decode_attention(q, k, v, 250, 0.125),
                               decode_attention_reference(q, k, v, 250, 0.125), atol=2e-6, rtol=0)


def test_attention_refuses_rows_past_the_cache():
    if cpu_ext.ops() is None:
        pytest.skip("the compiled kernels do not build here")
    k, v = _cache(2, 16, 64, torch.float32, seed=7)
    with pytest.raises(RuntimeError, match="slots 0 .. 17 are not all in the cache of 16"):
        decode_attention(torch.zeros(3, 4, 64), k, v, 15, 0.125)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [896, 100])
def test_rms_norm_matches_float64_and_is_row_by_row(library, dtype, tol, d):
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(9, d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    got = rms_norm(x, w, 1e-6)
    ref = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    assert all(torch.equal(got[i:i + 1], rms_norm(x[i:i + 1], w, 1e-6)) for i in range(9))
    assert torch.equal(rms_norm(x.view(3, 3, d), w, 1e-6), got.view(3, 3, d))
