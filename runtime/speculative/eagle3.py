"""`eagle3`: chain drafting with an EAGLE-3 head (docs/eagle3.md), same target vocabulary.

The head drafts over its reduced draft vocabulary; draft id d is target id d + d2t[d]. q is the
head's processed distribution over the draft vocabulary placed at those target ids (zero
elsewhere), so verification is standard speculative sampling (greedy: argmax matching) with
that q, lossless for any head. The head's KV cache is kept by the drafter: drafted slots are
run again with the target's own states once the target has verified them
(`eagle3.drafter.Eagle3Drafter`).
"""

from __future__ import annotations

import torch

from hetero_run.kernels.sampling import logits_to_probs
from hetero_run.runtime.eagle3.drafter import Eagle3Drafter
from hetero_run.runtime.speculative.proposer import Proposer
from hetero_run.runtime.speculative.round import RoundPlan
from hetero_run.topology.errors import ConfigError


class Eagle3Proposer(Proposer):
    name = "eagle3"

    def __init__(self, session, config):
        super().__init__(session, config)
        model = session.context.model if session.context is not None else None
        if not isinstance(model, Eagle3Drafter):
            raise ConfigError("algorithm 'eagle3' needs an EAGLE-3 head as the drafter (--drafter eagle3:PATH)",
                              field="algorithm")
        self.target_ids = model.draft_target_ids  # [draft_vocab]
        if int(self.target_ids.max()) >= session.target_vocab:
            raise ConfigError(f"the head drafts target ids up to {int(self.target_ids.max())}, the target's logits "
                              f"have {session.target_vocab}", field="d2t")
        self.head = model.prune_head(self.target_ids)

    def propose(self, k: int, start: int) -> RoundPlan:
        if k == 0:
            return self.empty(start)
        sampling, draw = self.session.draft_sampling, self.session.drawer(start)

        def choose(logits: torch.Tensor):  # [draft_vocab]
            q = logits_to_probs(logits[None], sampling)[0]  # [draft_vocab]
            j = draw(q, self.target_ids)
            return self.target_ids[j], q

        drafts, rows = self.session.context.draft(k, choose, head=self.head)
        q_target = torch.zeros(len(rows) + 1, self.session.target_vocab)  # [k + 1, target_vocab]
        q_target[:-1, self.target_ids] = torch.stack(rows)
        return RoundPlan(torch.tensor(drafts, dtype=torch.long), q_target, start, extras=drafts)

    def commit(self, plan: RoundPlan, emitted: list[int]) -> int:
        self.session.context.commit_ids(emitted)
        return len(emitted) - 1
