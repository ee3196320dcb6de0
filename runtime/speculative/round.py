"""The per-round metadata that the proposers write and the verifier and driver read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RoundPlan:
    """One speculative round (terms as in `verifier.RejectionSampler`).

    The target runs rows [last committed token] + draft_target_ids, a chain at positions
    `start` .. start + k, or a tree (`parents`, see `tree.DraftTree`) at positions start +
    depth; each row gives the target distribution p the verifier needs there.

    draft_probs row j is q at the model drafter's chain node j (row `model_rows[j]`; node 0 is
    row 0): the distribution the drafter drew its next token from, over the target vocabulary.
    The last row (j = c, after the drafter's last token) is zeros when the drafter stopped by
    choice (the bonus token then comes from p) and non-zero when it looked and proposed
    nothing there (SLRS), so the token there must come from the residual. None: no q, every
    draft token is a fixed candidate matched against the target's own choice (SLEM, prompt
    lookup, suffix trees).
    """

    draft_target_ids: torch.Tensor  # [n] int64: rows 1..n
    draft_probs: torch.Tensor | None  # [c + 1, target_vocab] float32, or None
    start: int  # target position of the last committed token, the first one run this round
    extras: object = field(default=None, repr=False)  # the proposer's own bookkeeping
    parents: list[int] | None = None  # [n + 1], parents[0] = -1; None: a chain
    model_rows: list[int] | None = None  # [c + 1] rows of the drafter's chain nodes; None: 0..c
    tree: object = field(default=None, repr=False)  # the DraftTree behind a merged round, if any

    @property
    def k(self) -> int:
        """Draft rows (target tokens) verified this round."""
        return int(self.draft_target_ids.numel())

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def parent_rows(self) -> list[int]:
        return self.parents if self.parents is not None else list(range(-1, self.k))

    def depths(self) -> list[int]:
        if self.parents is None:
            return list(range(self.k + 1))
        depth = [0] * (self.k + 1)
        for row in range(1, self.k + 1):
            depth[row] = depth[self.parents[row]] + 1
        return depth

    def chain_rows(self) -> list[int]:
        """Rows of the drafter's chain nodes 0..c."""
        if self.model_rows is not None:
            return self.model_rows
        c = self.draft_probs.shape[0] - 1 if self.draft_probs is not None else self.k
        return list(range(c + 1))

    def target_inputs(self, last_token: int) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
        """-> (ids [n + 1], positions [n + 1], parents [n + 1] or None for a chain)."""
        ids = torch.cat([torch.tensor([last_token], dtype=torch.long), self.draft_target_ids])
        if self.parents is None:
            return ids, torch.arange(self.start, self.start + ids.numel()), None
        return ids, self.start + torch.tensor(self.depths(), dtype=torch.long), list(self.parents)


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided: `token_ids` are the accepted tokens followed by one recovered
    or bonus token (len(token_ids) == accepted + 1); `rows` are the rows whose KV the target
    keeps: row 0, then the accepted path (len(rows) == accepted + 1)."""

    token_ids: list[int]
    rows: list[int]
    drafted: int  # draft rows verified

    @property
    def accepted(self) -> int:
        return len(self.token_ids) - 1
