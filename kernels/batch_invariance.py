"""The rule that makes speculative decoding and batching lossless: a row's bits never depend on
the rows that share its forward.

Greedy speculative decoding must emit exactly the tokens the target alone would. The target
alone decodes one token per forward; the verifier runs one forward of k + 1 tokens; a batching
engine puts many requests' rows (decode, verify, prefill chunks) into one forward. So every
layer computes row i of an n-row input bit for bit as it computes that row alone: the linear
kernels pick their code path without looking at n and sum each row in one fixed order, attention
runs each query row as a one-token decode would, the MoE block sums experts in one order.

With the compiled CPU kernels (cpu_ext.py) the linear layers hold this for any n
(`linear_rows_invariant()`). Without them the PyTorch fallback computes one row at a time up to
VERIFY_MAX_ROWS rows (`invariant(n)`) and takes torch's GEMM above, whose summation order
follows the shape; the target alone and the speculative engine prefill the same prompt the same
way, so they still agree. VERIFY_MAX_ROWS covers the longest verify (the drafters propose at
most 24 tokens, + 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

VERIFY_MAX_ROWS = 32


def invariant(n: int) -> bool:
    """Whether a forward of n tokens must give each row the bits of a one-token forward."""
    return n <= VERIFY_MAX_ROWS


def linear_rows_invariant(device: torch.device | str = "cpu") -> bool:
    """Whether dense_linear and nvfp4_linear give every row the bits it gets alone for forwards of
    any size on `device`: on the CPU with the compiled kernels, yes (every path, every n); the
    PyTorch fallback and the GPU paths only up to VERIFY_MAX_ROWS rows (CPU) or not at all."""
    from hetero_run.kernels import cpu_ext

    return torch.device(device).type == "cpu" and cpu_ext.ops() is not None


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for x [n, ...] computed one row at a time: the batch-invariant fallback for a product
    (torch's matrix products choose kernels, and so summation orders, by shape)."""
    if x.shape[0] == 1:
        return fn(x)
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
