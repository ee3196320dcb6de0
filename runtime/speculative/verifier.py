"""The verifier: a rejection sampler deciding which draft tokens the target keeps.

Vocabulary, used in every speculative module and doc (Leviathan et al. 2023 notation):

- p is the target distribution, q the drafter's (the proposal), both over the target
  vocabulary and both processed by `kernels.sampling.logits_to_probs` (temperature, top-k,
  top-p applied in that one place). Never the other way round.
- accepted tokens: the leading draft tokens the verifier keeps. Draft token x_i is accepted
  with probability min(1, p_i(x_i) / q_i(x_i)); greedy runs accept while x_i == argmax p_i.
- recovered token: the target's own token at the first rejection, drawn from the residual
  norm(max(0, p_i - q_i)) (argmax p_i when greedy). With it the emitted token follows p_i
  exactly: P(x) = min(q, p) + (1 - sum min(q, p)) * norm(max(0, p - q)) = p.
- bonus token: the target's extra token when every draft token was accepted, drawn from
  p_{k+1} (the residual against q row k, which is zero unless the proposer looked at that
  position and proposed nothing).

Exact-match verification (plan.draft_probs is None, SLEM): the target draws its own token
t'_i from p_i at every position; drafts are accepted while x_i == t'_i and the first
disagreeing t'_i is the recovered token. Every emitted token is the target's own draw, so
this is lossless for any draft.

The verifier works on tensors and returns one [k + 1] tensor, so the driver reads the result
with a single host sync per round.
"""

from __future__ import annotations

import torch

from hetero_run.kernels.sampling import SamplingParams, logits_to_probs
from hetero_run.runtime.speculative.round import RoundPlan

PLACEHOLDER = -1  # fills the output after the last emitted token


class RejectionSampler:
    def __init__(self, sampling: SamplingParams, generator: torch.Generator | None):
        self.sampling = sampling
        self.generator = None if sampling.greedy else generator
        if not sampling.greedy and generator is None:
            raise ValueError("sampled verification needs a generator")

    def __call__(self, plan: RoundPlan, target_logits: torch.Tensor) -> torch.Tensor:
        """target_logits [k + 1, vocab] -> emitted [k + 1]: accepted tokens, then the recovered
        or bonus token, then PLACEHOLDER."""
        draft = plan.draft_target_ids.to(target_logits.device)  # [k]
        if self.sampling.greedy:
            target_tokens = target_logits.argmax(-1)  # [k + 1]
            return self._emit_matching(draft, target_tokens)
        p = logits_to_probs(target_logits, self.sampling)  # [k + 1, vocab]
        if plan.draft_probs is None:
            return self._emit_matching(draft, self._draw(p))
        return self._emit_rejection(draft, p, plan.draft_probs.to(p.device))

    def _emit_matching(self, draft: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
        k = draft.numel()
        agree = (draft == target_tokens[:k]).long()  # [k]
        accepted = agree.cumprod(0).sum()  # leading agreements, 0-d tensor
        return self._assemble(draft, accepted, target_tokens[accepted])

    def _emit_rejection(self, draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        k = draft.numel()
        rows = torch.arange(k, device=p.device)
        p_draft, q_draft = p[rows, draft], q[rows, draft]  # [k]
        uniform = torch.rand(k, generator=self.generator, device=p.device)
        keep = self._accept(uniform, p_draft, q_draft).long()  # [k]
        accepted = keep.cumprod(0).sum()
        residual = self._residual(p[accepted], q[accepted])  # [vocab]
        token = torch.multinomial(residual, 1, generator=self.generator)[0]
        return self._assemble(draft, accepted, token)

    @staticmethod
    def _accept(uniform: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
        """Accept x_i with probability min(1, p/q): u < p/q, written without the division."""
        return uniform * q_draft < p_draft

    @staticmethod
    def _residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
        """norm(max(0, p - q)); p itself when q covers p everywhere (then rejection had
        probability 0 and only rounding can bring us here)."""
        residual = (p_row - q_row).clamp_min_(0)
        total = residual.sum()
        return torch.where(total > 0, residual / total.clamp_min(1e-30), p_row)

    def _draw(self, p: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(p, 1, generator=self.generator).squeeze(-1)

    @staticmethod
    def _assemble(draft: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        k = draft.numel()
        slots = torch.arange(k + 1, device=draft.device)
        padded = torch.cat([draft, draft.new_full((1,), PLACEHOLDER)])
        out = torch.where(slots < accepted, padded, torch.full_like(padded, PLACEHOLDER))
        return torch.where(slots == accepted, token.to(out.dtype), out)


def read_emitted(emitted: torch.Tensor) -> list[int]:
    """The round's one host sync: emitted [k + 1] -> the token ids, placeholders dropped."""
    return [t for t in emitted.tolist() if t != PLACEHOLDER]
