"""The gated SiLU MLP: fused column-parallel gate/up, row-parallel down (one all-reduce)."""

from __future__ import annotations

import torch

from hetero_run.kernels.decode_ops import silu_mul
from hetero_run.runtime.models.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP:
    def __init__(self, gate_up: ColumnParallelLinear, down: RowParallelLinear):
        self.gate_up = gate_up  # [n, hidden] -> [n, 2 * intermediate_local]: gate rows, then up rows
        self.down = down

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        return self.down(silu_mul(self.gate_up(x)))
