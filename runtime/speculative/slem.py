"""`slem`: string-level exact match (Timor et al. 2025, Algorithm 2) for any two vocabularies.

The drafter continues the conversation in its own tokens (argmax: the likeliest string is
the likeliest to match); the draft's text is re-tokenised for the target with the look-behind
window, keeping the target's committed tokens fixed; the target then picks its own token at
every position (argmax, or a draw from p) and the longest agreeing prefix is emitted with the
target's first disagreeing token. Every emitted token is the target's own choice: lossless,
and token-identical to the target alone when greedy.

Text edges: a draft that ends inside a UTF-8 character is cut at the last whole character;
when the accepted text itself ends mid-character (`context.pending`), the drafter has not
seen that partial character, so its draft must start with those bytes to be usable. A draft
that ends with a special token the target also has (`<|im_end|>`) proposes it too.
"""

from __future__ import annotations

import torch

from hetero_run.runtime.speculative.proposer import Proposer
from hetero_run.runtime.speculative.retokenize import utf8_complete
from hetero_run.runtime.speculative.round import RoundPlan


class SlemProposer(Proposer):
    name = "slem"
    unit = "drafter tokens"

    def propose(self, k: int, start: int) -> RoundPlan:
        if k == 0:
            return self.empty(start)
        context = self.session.context
        drafts, _ = context.draft(k, lambda logits: (logits.argmax(), None))
        special = next((i for i, token in enumerate(drafts) if context.pieces[token] is None), None)
        if special is not None:
            drafts = drafts[: special + 1]  # nothing after an end-of-turn token
        target_ids = self._translate(drafts)
        limit = min(self.config.max_target_draft, self.config.max_verify_rows - 1)
        return RoundPlan(torch.tensor(target_ids[:limit], dtype=torch.long), None, start, extras=drafts)

    def _translate(self, drafts: list[int]) -> list[int]:
        """Drafter tokens -> target tokens continuing the target's committed tokens."""
        pairing, context = self.session.pairing, self.session.context
        data = pairing.drafter_table.decode(drafts)
        pending = context.pending
        if not data.startswith(pending):
            return []
        complete = utf8_complete(data)
        new = data[len(pending):complete]
        keep, target_ids = pairing.target_retokenizer.extend(self.session.target_ids, new, rewrite=False)
        end = pairing.drafter_to_target_specials.get(drafts[-1])
        if end is not None and complete == len(data) and pairing.target_table.decode(target_ids) == new:
            target_ids.append(end)
        return target_ids

    def commit(self, plan: RoundPlan, emitted: list[int]) -> int:
        return self._commit_text(plan.extras, emitted)
