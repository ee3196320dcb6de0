"""The verifier: a rejection sampler walking the round's draft tree (a chain is a tree too).

Vocabulary, used in every speculative module and doc (Leviathan et al. 2023 notation):

- p is the target distribution, q the drafter's (the proposal), both over the target
  vocabulary and both processed by `kernels.sampling.logits_to_probs` (temperature, top-k,
  top-p applied in that one place). Never the other way round.
- accepted tokens: the draft tokens the verifier keeps, one path down the tree from row 0.
- recovered token: the target's own token where the walk stops, drawn from the residual
  (argmax p when greedy).
- bonus token: the target's extra token when the walk reaches a row with no children, drawn
  from p there (the residual against q row c, which is zero unless the proposer looked at that
  position and proposed nothing).

At each row the walk reaches, the candidates are its children: at most one drawn from q (the
model drafter's next chain token y, at a row of its chain) and any number of fixed ones
(prompt lookup, suffix tree, SLEM's re-tokenised draft: tokens chosen before the target ran,
whatever they depend on). Sampled, the row's target distribution r starts as p and:

1. q candidate: accept y with probability min(1, r(y) / q(y)); else r = norm(max(0, r - q)).
2. fixed candidates: draw t from r; if a child holds t, accept it, else t is the recovered token.

Step 1 outputs exactly r (P(x) = min(q, r) + (1 - sum min(q, r)) * norm(max(0, r - q)) = r);
step 2 outputs exactly r for any set of fixed tokens (the draw is the target's own). Each step
keeps the row's output distribution equal to p, so every emitted token follows p given the
path before it, which is the target alone's distribution: recursive rejection sampling
(SpecInfer, Miao et al. 2024) with fixed candidates as point-mass proposals. What must not
happen is choosing whether the q candidate is used from its own value or from anything the
drafter drew after it; rounds never do (the drafter's chain is always verified whole).
Greedy runs follow argmax p down the tree: the longest path the target alone would decode.

Keyed verification (`KeyedSampler`, seeded requests by default): the token at position t is
drawn by `kernels.sampling.sample_keyed` with noise that depends only on (seed, t), so the
walk's output is a function of the seed and the target's distributions alone: the tokens the
target alone draws with that seed, whatever was drafted, however the draft was cut to fit a
batch, and whatever else shared the forward. Each token follows p given the path before it
(the exponential race is an exact draw, and the noise of position t is independent of the
earlier positions' that chose the path), so the output distribution over seeds is the
target's. A draft is accepted when it equals that draw; drafters that draw their own tokens
with the same noise (`DraftSession.drawer`) agree with it as often as q and p allow
(coupled sampling), and q itself is not read.

Host reads: greedy reads every row's argmax at once; sampled reads one decision per row the
walk reaches (the draws happen lazily there, so rows the walk never reaches cost nothing).
"""

from __future__ import annotations

import torch

from hetero_run.kernels.sampling import SamplingParams, argmax_rows, logits_to_probs, sample_keyed
from hetero_run.runtime.speculative.round import RoundPlan, Verdict


def _tree(plan: RoundPlan) -> tuple[list[int], list[dict[int, int]]]:
    """The round's rows: their tokens (row 0: -1) and each row's children by token."""
    tokens = [-1] + plan.draft_target_ids.tolist()
    children: list[dict[int, int]] = [{} for _ in tokens]
    for row, parent in enumerate(plan.parent_rows()):
        if parent >= 0:
            children[parent].setdefault(tokens[row], row)
    return tokens, children


class RejectionSampler:
    def __init__(self, sampling: SamplingParams, generator: torch.Generator | None):
        self.sampling = sampling
        self.generator = None if sampling.greedy else generator
        if not sampling.greedy and generator is None:
            raise ValueError("sampled verification needs a generator")

    def __call__(self, plan: RoundPlan, target_logits: torch.Tensor) -> Verdict:
        """target_logits [n + 1, vocab] (one row per tree row) -> the round's Verdict."""
        tokens, children = _tree(plan)
        if self.sampling.greedy:
            return self._walk_greedy(argmax_rows(target_logits).tolist(), children, plan.k)
        return self._walk_sampled(plan, target_logits, tokens, children)

    @staticmethod
    def _walk_greedy(choice: list[int], children: list[dict[int, int]], drafted: int) -> Verdict:
        row, out, rows = 0, [], [0]
        while True:
            token = choice[row]
            out.append(token)
            row = children[row].get(token, -1)
            if row < 0:
                return Verdict(out, rows, drafted)
            rows.append(row)

    def _walk_sampled(self, plan: RoundPlan, target_logits: torch.Tensor, tokens: list[int],
                      children: list[dict[int, int]]) -> Verdict:
        q_node = {}
        if plan.draft_probs is not None:
            chain = plan.chain_rows()
            if len(chain) != plan.draft_probs.shape[0]:
                raise ValueError("sampled rounds verify the drafter's whole chain: every q row needs its node")
            q_node = {row: j for j, row in enumerate(chain)}
        row, out, rows = 0, [], [0]
        while True:
            p = logits_to_probs(target_logits[row:row + 1], self.sampling)[0]  # [vocab]
            j = q_node.get(row)
            if j is not None:
                q = plan.draft_probs[j].to(p.device)  # [vocab]
                if j + 1 < len(q_node):
                    y_row = plan.chain_rows()[j + 1]
                    y = tokens[y_row]
                    uniform = torch.rand((), generator=self.generator, device=p.device)
                    if bool(self._accept(uniform, p[y], q[y])):
                        out.append(y)
                        rows.append(y_row)
                        row = y_row
                        continue
                p = self._residual(p, q)
            token = self._choose(p, children[row])
            out.append(token)
            nxt = children[row].get(token, -1)
            if nxt < 0:
                return Verdict(out, rows, plan.k)
            rows.append(nxt)
            row = nxt

    @staticmethod
    def _accept(uniform: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
        """Accept y with probability min(1, p/q): u < p/q, written without the division."""
        return uniform * q_draft < p_draft

    @staticmethod
    def _residual(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
        """norm(max(0, p - q)); p itself when q covers p everywhere (then rejection had
        probability 0 and only rounding can bring us here)."""
        residual = (p_row - q_row).clamp_min_(0)
        total = residual.sum()
        return torch.where(total > 0, residual / total.clamp_min(1e-30), p_row)

    def _choose(self, r: torch.Tensor, children: dict[int, int]) -> int:
        """The target's own token from r; the walk moves on when a fixed candidate holds it."""
        return int(torch.multinomial(r, 1, generator=self.generator)[0])


class KeyedSampler:
    """Seeded sampled verification whose output does not depend on the drafts (see above)."""

    def __init__(self, sampling: SamplingParams):
        if sampling.greedy or sampling.seed is None:
            raise ValueError("keyed verification is for seeded sampled requests")
        self.sampling, self.seed = sampling, sampling.seed
        self.generator = sampling.generator()  # the proposers' own draws (SLRS's walk), seeded too

    def __call__(self, plan: RoundPlan, target_logits: torch.Tensor) -> Verdict:
        _, children = _tree(plan)
        depth = plan.depths()
        row, out, rows = 0, [], [0]
        while True:
            p = logits_to_probs(target_logits[row:row + 1], self.sampling)  # [1, vocab]
            token = int(sample_keyed(p, self.seed, [self._position(plan, depth[row])])[0])
            out.append(token)
            row = children[row].get(token, -1)
            if row < 0:
                return Verdict(out, rows, plan.k)
            rows.append(row)

    @staticmethod
    def _position(plan: RoundPlan, depth: int) -> int:
        """The position of the token a row at `depth` decides: its noise's key."""
        return plan.start + depth + 1


def verifier_for(sampling: SamplingParams, method: str = "keyed"):
    """The verifier of one request: argmax walks when greedy; `method` "keyed" for seeded sampled
    requests (reproducible under any batching and speculation), rejection sampling otherwise."""
    if method not in ("keyed", "rejection"):
        raise ValueError(f"unknown sampled verification {method!r} (keyed or rejection)")
    if not sampling.greedy and sampling.seed is not None and method == "keyed":
        return KeyedSampler(sampling)
    return RejectionSampler(sampling, None if sampling.greedy else sampling.generator())


def read_emitted(verdict: Verdict) -> list[int]:
    """The emitted token ids of a round (accepted tokens, then the recovered or bonus token)."""
    return verdict.token_ids
