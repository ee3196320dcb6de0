"""`standard`: speculative decoding with a drafter that shares the target's vocabulary.

Draft tokens are target tokens; q is the drafter's processed distribution (argmax when greedy).
The drafter's head may be wider or narrower than the target's logits (padding rows), so q is
cut or zero-padded to the target's width.
"""

from __future__ import annotations

import torch

from hetero_run.kernels.sampling import logits_to_probs
from hetero_run.runtime.speculative.proposer import Proposer
from hetero_run.runtime.speculative.round import RoundPlan


class StandardProposer(Proposer):
    name = "standard"

    def _q(self, logits: torch.Tensor) -> torch.Tensor:
        width = self.session.target_vocab
        logits = logits[:width]
        if logits.numel() < width:
            logits = torch.cat([logits, logits.new_full((width - logits.numel(),), float("-inf"))])
        return logits_to_probs(logits[None], self.session.draft_sampling)[0]  # [target_vocab]

    def propose(self, k: int, start: int) -> RoundPlan:
        if k == 0:
            return self.empty(start)
        draw = self.session.drawer(start)

        def choose(logits: torch.Tensor):
            q = self._q(logits)  # [target_vocab]
            return draw(q), q

        drafts, rows = self.session.context.draft(k, choose)
        rows.append(torch.zeros_like(rows[0]))  # bonus position: no proposal
        return RoundPlan(torch.tensor(drafts, dtype=torch.long), torch.stack(rows), start, extras=drafts)

    def commit(self, plan: RoundPlan, emitted: list[int]) -> int:
        self.session.context.commit_ids(emitted)
        return len(emitted) - 1
