"""Rotary position embeddings (the rotate-half layout Hugging Face checkpoints use)."""

from __future__ import annotations

import torch

from hetero_run.runtime.models.config import RopeConfig


class Rotary:
    """cos / sin tables for positions 0 .. max_positions - 1, built once.

    The sign of rotate_half is folded into the sin table: rotate_half(x) = [-x2, x1], and
    x.roll(D / 2) = [x2, x1], so x * cos + rotate_half(x) * sin == x * cos + x.roll(D / 2) * sin_signed
    with sin_signed = [-sin1, sin2], exactly (a sign flip rounds nothing).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope.inv_freq(head_dim)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        half = head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = (emb.sin() * sign).to(dtype=dtype, device=device)
        self.half = half
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n] positions -> cos, sin as [n, 1, head_dim], broadcasting over heads."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, heads, head_dim] rotated by its positions' angles."""
        return x * cos + x.roll(self.half, dims=-1) * sin
