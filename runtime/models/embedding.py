"""Vocabulary-parallel embedding and LM head: each rank holds vocab / size rows.

The embedding looks up the ids that fall in this rank's rows, zeroes the others and sums
over the group (one all-reduce). The head computes this rank's slice of the logits and
gathers the full [n, vocab] on rank 0 only: the sampler and verifier live there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.runtime.models.linear import Weight
from hetero_run.runtime.models.parallel import ParallelContext


class VocabParallelEmbedding:
    def __init__(self, weight: torch.Tensor, ctx: ParallelContext):
        self.weight = weight  # [vocab / size, hidden]
        self.ctx = ctx
        self.rows = weight.shape[0]
        self.first = ctx.rank * self.rows  # first vocabulary id held here

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if self.ctx.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.ctx.all_reduce(out)


class ParallelLMHead:
    def __init__(self, weight: Weight, ctx: ParallelContext, tied: bool = False):
        self.weight = weight  # [vocab / size, hidden]
        self.ctx = ctx
        self.tied = tied  # shares the embedding's tensor

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:  # [n, hidden] -> [n, vocab] on rank 0
        logits = self.ctx.gather_first(self.weight.matmul(h))
        return logits.float() if logits is not None else None
