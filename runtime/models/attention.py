"""Grouped-query self-attention over this rank's heads, reading and appending to the KV cache.

At TP size s a rank holds num_heads / s query heads and the KV heads they read: num_kv_heads / s
of them, or, when there are fewer KV heads than ranks, the one KV head its query heads share
(replicated on size / num_kv_heads ranks). q/k/v is one fused column-parallel projection,
o one row-parallel projection: one all-reduce per attention.

Up to VERIFY_MAX_ROWS tokens (decode, speculative verify) each query row attends over exactly
the keys a one-token decode of it would see, without a mask, so it gets the decode's bits
(batch_invariance.py; kernels/decode_ops.py, compiled on the CPU); longer chunks (prefill) and
drafter trees take one masked scaled_dot_product_attention call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.kernels.decode_ops import decode_attention
from hetero_run.runtime.models.linear import ColumnParallelLinear, RowParallelLinear
from hetero_run.runtime.models.rotary import Rotary


class Attention:
    def __init__(self, qkv: ColumnParallelLinear, o: RowParallelLinear, rotary: Rotary, heads: int,
                 kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6):
        self.qkv, self.o, self.rotary = qkv, o, rotary
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qk_size = (heads + kv_heads) * head_dim  # q and k are adjacent in the fused output
        self.k_cache, self.v_cache = k_cache, v_cache  # [kv_heads, max_tokens, head_dim] views
        self.qk_norm = None  # [heads + kv_heads, head_dim]: q_norm for the q heads, then k_norm (qwen3 family)
        if q_norm is not None:
            self.qk_norm = torch.cat([q_norm.expand(heads, head_dim), k_norm.expand(kv_heads, head_dim)])
        self.eps = eps
        self.scale = head_dim ** -0.5

    @property
    def nbytes(self) -> int:
        norms = 0 if self.qk_norm is None else 2 * self.head_dim * self.qk_norm.element_size()
        return self.qkv.nbytes + self.o.nbytes + norms

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """x [n, hidden] at cache slots start .. start + n - 1 -> [n, hidden] (summed over ranks).

        cos / sin: [n, 1, head_dim]; mask: [n, start + n] bool (True = may attend), or None for
        causal attention computed row by row, each row exactly as a one-token decode computes it
        (the decoder passes None up to VERIFY_MAX_ROWS tokens; a drafter's tree passes its mask).
        """
        n = x.shape[0]
        qkv = self.qkv(x)  # [n, (heads + 2 * kv_heads) * head_dim]
        qk = qkv[:, :self.qk_size].view(n, self.heads + self.kv_heads, self.head_dim)
        v = qkv[:, self.qk_size:].view(n, self.kv_heads, self.head_dim)
        if self.qk_norm is not None:  # q and k normalised (and then rotated) together
            qk = F.rms_norm(qk, (self.head_dim,), eps=self.eps) * self.qk_norm
        q, k = self.rotary.apply(qk, cos, sin).split((self.heads, self.kv_heads), dim=1)
        end = start + n
        self.k_cache[:, start:end] = k.transpose(0, 1)
        self.v_cache[:, start:end] = v.transpose(0, 1)
        if mask is None:  # causal, each row as a one-token decode (the decoder passes a mask only for long chunks
            out = decode_attention(q, self.k_cache, self.v_cache, start, self.scale)  # and drafter trees)
            return self.o(out.reshape(n, self.heads * self.head_dim))
        out = self._attend(q.transpose(0, 1)[None], end, mask)  # [1, heads, n, head_dim]
        return self.o(out[0].transpose(0, 1).reshape(n, self.heads * self.head_dim))

    def _attend(self, q: torch.Tensor, keys: int, mask: torch.Tensor | None) -> torch.Tensor:
        """q [1, heads, m, head_dim] over cache slots 0 .. keys - 1 -> [1, heads, m, head_dim]."""
        # 4-D inputs take PyTorch's fused CPU attention kernel; 3-D ones fall back to the slow path.
        return F.scaled_dot_product_attention(
            q, self.k_cache[None, :, :keys], self.v_cache[None, :, :keys],
            attn_mask=mask, scale=self.scale, enable_gqa=self.heads != self.kv_heads,
        )
