"""The per-round metadata that the proposer writes and the verifier and driver read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RoundPlan:
    """One speculative round (terms as in `verifier.RejectionSampler`).

    The driver runs the target over [last committed token] + draft_target_ids at positions
    `start` .. start + k, which yields the k + 1 target distributions p the verifier needs.

    draft_probs row i is q for draft token i (for i < k), over the target vocabulary; row k
    is the proposal mass at the position after the draft: zeros when the proposer stopped
    by choice (the bonus token then comes from p), non-zero when it looked and proposed
    nothing there (SLRS), so the token there must come from the residual. None means the
    algorithm has no q: the target's own tokens are matched against the draft (SLEM).
    """

    draft_target_ids: torch.Tensor  # [k] int64
    draft_probs: torch.Tensor | None  # [k + 1, target_vocab] float32, or None
    start: int  # target position of the last committed token, the first one run this round
    extras: object = field(default=None, repr=False)  # the proposer's own bookkeeping

    @property
    def k(self) -> int:
        return int(self.draft_target_ids.numel())

    def target_inputs(self, last_token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ids [k + 1], positions [k + 1]) for the target's verify forward."""
        ids = torch.cat([torch.tensor([last_token], dtype=torch.long), self.draft_target_ids])
        return ids, torch.arange(self.start, self.start + ids.numel())


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided: `token_ids` are the accepted tokens followed by one recovered
    or bonus token, so len(token_ids) == accepted + 1."""

    accepted: int
    token_ids: list[int]
    drafted: int  # k

    @property
    def bonus(self) -> bool:
        return self.accepted == self.drafted
