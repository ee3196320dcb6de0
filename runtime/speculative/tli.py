"""`tli`: token-level intersection (Timor et al. 2025, Algorithm 4).

The drafter's head is pruned to the tokens both vocabularies share (equal bytes, see
`vocab.Intersection`), so it drafts only tokens the target has: q is the drafter's
distribution conditioned on the intersection (a softmax over the pruned logits), moved to the
target's ids. Verification is then standard speculative sampling with that q, lossless for
any proposal. Weak when the intersection is small.
"""

from __future__ import annotations

import torch

from hetero_run.kernels.sampling import logits_to_probs
from hetero_run.runtime.speculative.proposer import Proposer
from hetero_run.runtime.speculative.round import RoundPlan


class TliProposer(Proposer):
    name = "tli"

    def __init__(self, session, config):
        super().__init__(session, config)
        shared = session.pairing.intersection
        inside = shared.target_ids < session.target_vocab  # a tokenizer may know ids the head lacks
        self.draft_ids = shared.draft_ids[inside]  # [shared]
        self.target_ids = shared.target_ids[inside]  # [shared]
        self.head = session.context.model.prune_head(self.draft_ids)

    def propose(self, k: int, start: int) -> RoundPlan:
        context = self.session.context
        if k == 0 or not context.draft_ready:
            return self.empty(start)
        sampling, draw = self.session.draft_sampling, self.session.drawer(start)

        def choose(logits: torch.Tensor):  # logits over the shared tokens
            q = logits_to_probs(logits[None], sampling)[0]  # [shared]
            j = draw(q, self.target_ids)
            return self.draft_ids[j], (j, q)

        drafts, picks = context.draft(k, choose, head=self.head)
        special = next((i for i, token in enumerate(drafts) if context.pieces[token] is None), None)
        if special is not None:  # nothing after an end-of-turn token
            drafts, picks = drafts[: special + 1], picks[: special + 1]
        targets = self.target_ids[torch.stack([j for j, _ in picks])]  # [k]
        q_target = torch.zeros(len(picks) + 1, self.session.target_vocab)  # [k + 1, target_vocab]
        q_target[:-1, self.target_ids] = torch.stack([q for _, q in picks])
        return RoundPlan(targets, q_target, start, extras=drafts)

    def commit(self, plan: RoundPlan, emitted: list[int]) -> int:
        return self._commit_text(plan.extras, emitted)
