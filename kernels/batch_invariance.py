"""The rule that makes speculative decoding lossless: small forwards are batch-invariant.

Greedy speculative decoding must emit exactly the tokens the target alone would. The target
alone decodes one token per forward; the verifier runs one forward of k + 1 tokens. So for any
n <= VERIFY_MAX_ROWS, every layer computes row i of an n-row input bit for bit as it computes
that row alone: the linear kernels pick their code path without looking at n, attention runs
each query row as a one-token decode would, the MoE block sums experts in one order. Larger
forwards (prompt prefill) take the fastest path; the target alone and the speculative engine
prefill the same prompt the same way, so they still agree.

VERIFY_MAX_ROWS covers the longest verify (the drafters propose at most 24 tokens, + 1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

VERIFY_MAX_ROWS = 32


def invariant(n: int) -> bool:
    """Whether a forward of n tokens must give each row the bits of a one-token forward."""
    return n <= VERIFY_MAX_ROWS


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for x [n, ...] computed one row at a time: the batch-invariant fallback for a product
    (torch's matrix products choose kernels, and so summation orders, by shape)."""
    if x.shape[0] == 1:
        return fn(x)
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
