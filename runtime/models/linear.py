"""Tensor-parallel linear layers over the project's weight objects (dense or NVFP4).

A weight computes `matmul(x) -> x @ W.T` for x [n, in]; these layers add the bias and the
collective. Column-parallel layers hold a slice of the output features and need no
communication; row-parallel layers hold a slice of the input features and sum their partial
products over the group with one all-reduce. A fused projection (q/k/v, gate/up) is one
column-parallel layer whose weight concatenates the parts along the output dimension.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hetero_run.runtime.models.parallel import ParallelContext


class Weight(Protocol):
    out_features: int
    in_features: int
    nbytes: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...  # [n, in] -> [n, out]

    def matmul_float(self, x: torch.Tensor) -> torch.Tensor: ...  # matmul(x).float()


class ColumnParallelLinear:
    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias  # [out_local]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out_local]
        y = self.weight.matmul(x)
        if self.bias is not None:
            y += self.bias
        return y


class RowParallelLinear:
    def __init__(self, weight: Weight, ctx: ParallelContext, bias: torch.Tensor | None = None):
        self.weight = weight
        self.ctx = ctx
        self.bias = bias  # [out], full: added once, after the sum

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.bias.nbytes if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in_local] -> [n, out]
        return self.reduce(self.weight.matmul(x))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's product y [n, out] -> the layer's output: summed over the group, plus the bias."""
        y = self.ctx.all_reduce(y)
        if self.bias is not None:
            y += self.bias
        return y
