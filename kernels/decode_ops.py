"""The per-token operations between a decoder layer's matrix products: attention of a few new
tokens over the KV cache, RMS norm and the gated MLP's silu(gate) * up. The compiled CPU
kernels (`csrc/decode_ops.cpp`) where they apply, PyTorch otherwise.

Each computes every row on its own, in an order that does not depend on how many rows came
together, so decode and verify forwards stay batch-invariant (batch_invariance.py). The
PyTorch paths are the references: attention one query row at a time through
`scaled_dot_product_attention` (its fused CPU kernel, over exactly that row's keys),
`F.rms_norm`, and `F.silu(gate) * up`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.kernels import cpu_ext

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, heads, d] at cache slots start .. start + n - 1; k, v [kv_heads, slots, d] (the
    cache, keys of the new rows already written) -> [n, heads, d]. Row i attends to slots
    0 .. start + i; query head h reads KV head h // (heads // kv_heads)."""
    lib = cpu_ext.ops()
    if (lib is not None and q.is_cpu and q.dtype in KERNEL_DTYPES and q.dtype == k.dtype == v.dtype
            and k.stride(2) == 1 and v.stride(2) == 1 and k.stride(1) == v.stride(1)):
        return lib.decode_attention(q.contiguous(), k, v, start, scale)
    return decode_attention_reference(q, k, v, start, scale)


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                               scale: float) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[0]
    rows = q.transpose(0, 1)[None]  # [1, heads, n, d]; 4-D inputs take PyTorch's fused CPU kernel
    out = [F.scaled_dot_product_attention(rows[:, :, i:i + 1], k[None, :, :start + i + 1], v[None, :, :start + i + 1],
                                          scale=scale, enable_gqa=heads != kv_heads)
           for i in range(q.shape[0])]
    return torch.cat(out, dim=2)[0].transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_slots: torch.Tensor,
                    key_offsets: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, heads, d]; k, v [kv_heads, slots, d] (the cache, keys of the new rows already
    written); key_slots [total] int64, key_offsets [n + 1] int64 -> [n, heads, d]. Row i attends,
    in this order, to the cache slots key_slots[key_offsets[i]:key_offsets[i + 1]]; query head h
    reads KV head h // (heads // kv_heads). Each row's result depends only on the keys it reads,
    so a verify or tree row reading the keys a one-token decode reads gets the decode's bits."""
    lib = cpu_ext.ops()
    if (lib is not None and q.is_cpu and q.dtype in KERNEL_DTYPES and q.dtype == k.dtype == v.dtype
            and k.stride(2) == 1 and v.stride(2) == 1 and k.stride(1) == v.stride(1)):
        return lib.paged_attention(q.contiguous(), k, v, key_slots, key_offsets, scale)
    return paged_attention_reference(q, k, v, key_slots, key_offsets, scale)


def paged_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_slots: torch.Tensor,
                              key_offsets: torch.Tensor, scale: float) -> torch.Tensor:
    heads, kv_heads = q.shape[1], k.shape[0]
    rows = q.transpose(0, 1)[None]  # [1, heads, n, d]
    bounds = key_offsets.tolist()
    out = []
    for i in range(q.shape[0]):
        slots = key_slots[bounds[i]:bounds[i + 1]].to(k.device)
        out.append(F.scaled_dot_product_attention(rows[:, :, i:i + 1], k[None, :, slots], v[None, :, slots],
                                                  scale=scale, enable_gqa=heads != kv_heads))
    return torch.cat(out, dim=2)[0].transpose(0, 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] / sqrt(mean(x^2) + eps) * weight [d], in x's dtype (called ~50 times a token:
    the checks are kept to a few attribute reads)."""
    lib = cpu_ext.ops()
    if lib is not None and x.is_cpu and x.dtype in KERNEL_DTYPES and x.dtype == weight.dtype:
        if x.dim() == 2 and x.is_contiguous():
            return lib.rms_norm(x, weight, eps)
        return lib.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps).view(x.shape)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2f] (gate the first f columns) -> [..., f] in its dtype.

    The compiled kernel computes in float32 and rounds once; PyTorch (the reference, and the
    path without the library) rounds silu(gate) to the dtype before multiplying."""
    lib = cpu_ext.ops()
    if lib is not None and gate_up.is_cpu and gate_up.dtype in KERNEL_DTYPES:
        flat = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        return lib.silu_mul(flat).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return silu_mul_reference(gate_up)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, write_slots: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotary on the q and k heads of qk [n, heads + kv_heads, d] (cos, sin [n, 1, d] with sin's
    sign folded in, runtime/models/rotary.py), the rotated k and v [n, kv_heads, d] written to
    the caches [kv_heads, slots, d] at write_slots [n]; -> q [n, heads, d]. The compiled kernel
    (bf16) gives PyTorch's bits in one call instead of seven."""
    lib = cpu_ext.ops()
    if (lib is not None and qk.is_cpu and qk.dtype == torch.bfloat16 and v.dtype == cos.dtype == sin.dtype
            == k_cache.dtype == v_cache.dtype == torch.bfloat16 and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2]
            and v.stride(2) == 1 and v.stride(1) == v.shape[2] and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
            and k_cache.stride(1) == k_cache.shape[2] and v_cache.stride(1) == v_cache.shape[2]):
        n, d = qk.shape[0], qk.shape[2]
        return lib.rope_write(qk, v, cos.reshape(n, d).contiguous(), sin.reshape(n, d).contiguous(), k_cache,
                              v_cache, write_slots.contiguous(), heads)
    return rope_write_reference(qk, v, cos, sin, k_cache, v_cache, write_slots, heads)


def rope_write_reference(qk, v, cos, sin, k_cache, v_cache, write_slots, heads):
    rotated = qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin
    q, k = rotated.split((heads, qk.shape[1] - heads), dim=1)
    k_cache[:, write_slots] = k.transpose(0, 1)
    v_cache[:, write_slots] = v.transpose(0, 1)
    return q
