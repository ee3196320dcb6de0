"""Attention over the KV cache, RMS norm and silu(gate) * up (kernels/decode_ops.py): the compiled kernels against
float64 references and PyTorch, and row i of an n-row call equal bit for bit to that row alone."""

import math

import pytest
import torch

from hetero_run.kernels import cpu_ext
from hetero_run.kernels.decode_ops import (
    decode_attention,
    decode_attention_reference,
    paged_attention,
    paged_attention_reference,
    rms_norm,
    rope_write,
    rope_write_reference,
    silu_mul,
    silu_mul_reference,
)


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
def test_attention_matches_float64(row_ops, dtype, tol, heads, kv_heads, d):
    k, v = _cache(kv_heads, 90, d, dtype, seed=d)
    q = torch.randn(5, heads, d, generator=torch.Generator().manual_seed(heads)).to(dtype)
    got = decode_attention(q, k, v, 37, 1 / math.sqrt(d))
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), _attention_float64(q, k, v, 37, 1 / math.sqrt(d)), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 40])
def test_attention_rows_do_not_depend_on_the_batch(row_ops, dtype, d):
    k, v = _cache(2, 200, d, dtype, seed=3)
    q = torch.randn(25, 14, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    together = decode_attention(q, k, v, 100, 0.125)
    for i in range(q.shape[0]):
        alone = decode_attention(q[i:i + 1], k, v, 100 + i, 0.125)
        assert torch.equal(together[i:i + 1], alone), i


@pytest.mark.parametrize("heads, kv_heads, d", [(7, 1, 64), (14, 2, 64), (12, 4, 64), (8, 2, 128), (6, 2, 40)],
                         ids=["7-on-1", "14-on-2", "12-on-4", "8-on-2-d128", "6-on-2-d40"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_attention_bits_do_not_depend_on_how_heads_are_shared_out(row_ops, heads, kv_heads, d, threads):
    # The AVX2 path gives a task several query heads of one KV head (each chunk of keys widened
    # once for all of them), cut into parts by rows x KV heads and the thread count: a one-row
    # decode of a TP=2 rank (7 heads on 1) splits its group, 9 rows do not. Every head's bits stay
    # those of the head computed on its own (one head per call, one thread).
    k, v = _cache(kv_heads, 150, d, torch.bfloat16, seed=11)
    q = torch.randn(9, heads, d, generator=torch.Generator().manual_seed(12)).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.stack([torch.cat([decode_attention(q[i:i + 1, h:h + 1], k[h // (heads // kv_heads)][None], v[
            h // (heads // kv_heads)][None], 60 + i, 0.125) for h in range(heads)], dim=1)[0] for i in range(9)])
        torch.set_num_threads(threads)
        for n in (1, 2, 3, 9):
            assert torch.equal(decode_attention(q[:n], k, v, 60, 0.125), alone[:n]), n
        assert torch.equal(decode_attention(q[4:5], k, v, 64, 0.125), alone[4:5])
    finally:
        torch.set_num_threads(before)


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
def test_rms_norm_matches_float64_and_is_row_by_row(row_ops, dtype, tol, d):
    g = torch.Generator().manual_seed(d)
    x, w = torch.randn(9, d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    got = rms_norm(x, w, 1e-6)
    ref = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    assert all(torch.equal(got[i:i + 1], rms_norm(x[i:i + 1], w, 1e-6)) for i in range(9))
    assert torch.equal(rms_norm(x.view(3, 3, d), w, 1e-6), got.view(3, 3, d))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("f", [4864, 37, 16, 1])
def test_silu_mul_matches_float64_and_is_row_by_row(row_ops, dtype, tol, f):
    """silu(gate) * up within the dtype's rounding (the kernel rounds once, PyTorch twice), each
    row alone as in a batch, whatever f's remainder by the vector width; the AVX-512 loop and
    the scalar one alike, at each vector width. Extreme gates in the kernels: silu(-inf) is 0
    (PyTorch's -inf / inf gives NaN), silu(+inf) inf."""
    g = torch.Generator().manual_seed(f)
    x = (torch.randn(9, 2 * f, generator=g) * 4).to(dtype)
    x[0, :min(f, 5)] = torch.tensor([-100.0, 100.0, 0.0, -1e4, 30.0])[:min(f, 5)].to(dtype)
    gate, up = x[:, :f].double(), x[:, f:].double()
    ref = gate * torch.sigmoid(gate) * up
    got = silu_mul(x)
    assert got.dtype == dtype and got.shape == (9, f)
    torch.testing.assert_close(got.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    assert all(torch.equal(got[i:i + 1], silu_mul(x[i:i + 1])) for i in range(9))
    assert torch.equal(silu_mul(x.view(3, 3, 2 * f)), got.view(3, 3, f))
    if row_ops != "pytorch":
        edges = torch.tensor([[float("-inf"), float("inf"), -90.0, 2.0, 2.0, 2.0, 3.0, 5.0]], dtype=dtype)
        silu_2 = 2 / (1 + math.exp(-2))
        assert silu_mul(edges).float().tolist() == [[0.0, float("inf"), 0.0, pytest.approx(silu_2 * 5, rel=tol)]]
    torch.testing.assert_close(silu_mul_reference(x).double(), ref, atol=2 * tol * ref.abs().max().item(), rtol=2 * tol)


@pytest.mark.parametrize("heads, kv_heads, d", [(14, 2, 64), (4, 4, 128), (2, 1, 40)])
def test_rope_write_gives_pytorchs_bits_and_fills_the_slots(row_ops, heads, kv_heads, d):
    """The compiled rotary + cache write equals PyTorch's three bf16 operations and two index_put
    bit for bit: q, and the k and v rows at their slots (nothing else in the cache moves), for q/k
    as a strided view of the fused qkv output, at each vector width (d = 40 has a half of 20,
    which takes the scalar loop everywhere)."""
    if row_ops == "pytorch":
        pytest.skip("the PyTorch path is the reference itself")
    lib = cpu_ext.ops()
    g = torch.Generator().manual_seed(d)
    n, slots = 5, 32
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * d, generator=g) * 3).bfloat16()
    qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    angles = torch.randn(n, 1, d, generator=g) * 3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    write = torch.randperm(slots, generator=g)[:n]
    cache = torch.randn(2, 3, kv_heads, slots, d, generator=g).bfloat16()  # [k|v, layer, ...]: a layer's view
    want_k, want_v = cache[0, 1].clone(), cache[1, 1].clone()
    want_q = rope_write_reference(qk, v, cos, sin, want_k, want_v, write, heads)
    k_cache, v_cache = cache[0, 1].clone(), cache[1, 1].clone()
    q = rope_write(qk, v, cos, sin, k_cache, v_cache, write, heads)
    assert q.is_contiguous() and torch.equal(q, want_q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="write slot 32 is outside the cache of 32"):
        lib.rope_write(qk, v, cos.reshape(n, d), sin.reshape(n, d), cache[0, 1], cache[1, 1],
                       torch.tensor([0, 1, 2, 3, slots]), heads)


def _key_lists(g, rows, slots):
    """Per row a random list of distinct cache slots (a paged table, a tree row's ancestors)."""
    lists = [torch.randperm(slots, generator=g)[:int(torch.randint(1, slots, (1,), generator=g))] for _ in range(rows)]
    offsets = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    return torch.cat(lists), offsets, lists


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads, kv_heads, d", [(14, 2, 64), (4, 2, 40)])
def test_paged_attention_matches_float64_over_listed_slots(row_ops, dtype, tol, heads, kv_heads, d):
    g = torch.Generator().manual_seed(d + heads)
    k, v = _cache(kv_heads, 70, d, dtype, seed=d)
    q = torch.randn(6, heads, d, generator=g).to(dtype)
    slots, offsets, lists = _key_lists(g, 6, 70)
    got = paged_attention(q, k, v, slots, offsets, 1 / math.sqrt(d))
    group = heads // kv_heads
    want = torch.empty(q.shape, dtype=torch.float64)
    for i, keys in enumerate(lists):
        for h in range(heads):
            p = torch.softmax(k[h // group, keys].double() @ q[i, h].double() / math.sqrt(d), dim=0)
            want[i, h] = p @ v[h // group, keys].double()
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
    torch.testing.assert_close(paged_attention_reference(q, k, v, slots, offsets, 1 / math.sqrt(d)).double(), want,
                               atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_attention_over_the_same_keys_gives_the_decode_bits(row_ops, dtype):
    # A row reading slots 0 .. s in order equals the one-token decode at slot s, bit for bit, and a
    # row whose keys are scattered copies of those keys gives the same bits too.
    k, v = _cache(2, 120, 64, dtype, seed=7)
    q = torch.randn(4, 14, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    ends = [10, 33, 59, 59]
    slots = torch.cat([torch.arange(e + 1) for e in ends])
    offsets = torch.tensor([0] + [e + 1 for e in ends]).cumsum(0)
    got = paged_attention(q, k, v, slots, offsets, 0.125)
    for i, e in enumerate(ends):
        assert torch.equal(got[i:i + 1], decode_attention(q[i:i + 1], k, v, e, 0.125)), i
    moved = torch.randperm(60, generator=torch.Generator().manual_seed(9)) + 60  # keys 0..59 copied to 60..119
    k[:, moved], v[:, moved] = k[:, :60].clone(), v[:, :60].clone()
    scattered = paged_attention(q[3:], k, v, moved, torch.tensor([0, 60]), 0.125)
    assert torch.equal(scattered, got[3:])


def test_paged_attention_rejects_slots_outside_the_cache(row_ops):
    if row_ops == "pytorch":
        pytest.skip("the compiled op's bounds checks; the PyTorch path indexes with torch's own")
    k, v = _cache(2, 16, 64, torch.float32, seed=1)
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="outside the cache of 16"):
        paged_attention(q, k, v, torch.tensor([3, 16]), torch.tensor([0, 2]), 0.125)
    with pytest.raises(RuntimeError, match="attends to no key"):
        paged_attention(q, k, v, torch.tensor([], dtype=torch.long), torch.tensor([0, 0]), 0.125)
