"""Vocabulary-parallel embedding and LM head: each rank holds a range of the vocabulary's rows.

The embedding looks up the ids that fall in this rank's rows, zeroes the others and sums
over the group (one all-reduce; exact, since every id has one owner). The head computes this
rank's slice of the logits and gathers the full [n, vocab] on rank 0 only: the sampler and
verifier live there.

The head's rows are split evenly: it is read on every forward, and the ranks wait for the
slowest. The embedding's rows need not be: a lookup reads one row per token, so who holds which
rows costs nothing at run time, and `balanced_rows` uses that to even out memory. Rank 0 alone
holds the tokenizer and the drafter; it gives embedding rows to the other ranks until the ranks
are as evenly full as the embedding allows (a tied head shares the embedding's tensor, so tied
models keep the even split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero_run.runtime.models.linear import Weight
from hetero_run.runtime.models.parallel import ParallelContext


class VocabParallelEmbedding:
    def __init__(self, weight: torch.Tensor, ctx: ParallelContext, first: int | None = None):
        self.weight = weight  # [rows held here, hidden]
        self.ctx = ctx
        self.rows = weight.shape[0]
        self.first = ctx.rank * self.rows if first is None else first  # first vocabulary id held here

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if self.ctx.size == 1:
            return F.embedding(ids, self.weight)
        if self.rows == 0:  # this rank holds none of the vocabulary: its share of the sum is zero
            return self.ctx.all_reduce(self.weight.new_zeros((ids.shape[0], self.weight.shape[1])))
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

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:  # [n, hidden] -> [n, vocab] float32 on rank 0
        if self.ctx.size == 1:  # straight into float32 (many rows' logits are tens of MB)
            return self.weight.matmul_float(h)
        logits = self.ctx.gather_first(self.weight.matmul(h))  # the model's dtype over the link
        return logits.float() if logits is not None else None
