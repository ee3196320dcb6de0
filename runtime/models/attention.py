"""Grouped-query self-attention over this rank's heads, reading and writing the paged KV cache.

At TP size s a rank holds num_heads / s query heads and the KV heads they read: num_kv_heads / s
of them, or, when there are fewer KV heads than ranks, the one KV head its query heads share
(replicated on size / num_kv_heads ranks). q/k/v is one fused column-parallel projection,
o one row-parallel projection: one all-reduce per attention.

Every row (decode, verify, tree node, prefill) writes its K/V to its slot and then attends to
exactly the keys its `AttentionRows` entry lists, in order, computed on its own
(kernels/decode_ops.py, compiled on the CPU): a row's result never depends on which other rows
came with it (batch_invariance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetero_run.kernels.decode_ops import paged_attention, rope_write
from hetero_run.runtime.models.linear import ColumnParallelLinear, RowParallelLinear
from hetero_run.runtime.models.rotary import Rotary


@dataclass(frozen=True)
class AttentionRows:
    """What every layer's attention needs about the rows of one forward (built once per forward)."""

    write_slots: torch.Tensor  # [n] int64 physical slot of each row's K/V
    key_slots: torch.Tensor  # [T] int64 physical slots read, row after row
    key_offsets: torch.Tensor  # [n + 1] int64 bounds of each row's keys in key_slots


class Attention:
    def __init__(self, qkv: ColumnParallelLinear, o: RowParallelLinear, rotary: Rotary, heads: int,
                 kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6):
        self.qkv, self.o, self.rotary = qkv, o, rotary
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qk_size = (heads + kv_heads) * head_dim  # q and k are adjacent in the fused output
        self.k_cache, self.v_cache = k_cache, v_cache  # [kv_heads, slots, head_dim] views
        self.qk_norm = None  # [heads + kv_heads, head_dim]: q_norm for the q heads, then k_norm (qwen3 family)
        if q_norm is not None:
            self.qk_norm = torch.cat([q_norm.expand(heads, head_dim), k_norm.expand(kv_heads, head_dim)])
        self.eps = eps
        self.scale = head_dim ** -0.5

    @property
    def nbytes(self) -> int:
        norms = 0 if self.qk_norm is None else 2 * self.head_dim * self.qk_norm.element_size()
        return self.qkv.nbytes + self.o.nbytes + norms

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: AttentionRows) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden] (summed over ranks); cos / sin: [n, 1, head_dim]."""
        n = x.shape[0]
        qkv = self.qkv(x)  # [n, (heads + 2 * kv_heads) * head_dim]
        qk = qkv[:, :self.qk_size].view(n, self.heads + self.kv_heads, self.head_dim)
        v = qkv[:, self.qk_size:].view(n, self.kv_heads, self.head_dim)
        if self.qk_norm is not None:  # q and k normalised (and then rotated) together
            qk = F.rms_norm(qk, (self.head_dim,), eps=self.eps) * self.qk_norm
        # q and k rotated (Rotary.apply's arithmetic), k and v written to their slots
        q = rope_write(qk, v, cos, sin, self.k_cache, self.v_cache, rows.write_slots, self.heads)
        out = paged_attention(q, self.k_cache, self.v_cache, rows.key_slots, rows.key_offsets, self.scale)
        return self.o(out.reshape(n, self.heads * self.head_dim))
