"""The verifier on trees: hand-built logits, greedy paths, and sampled rows with several fixed
candidates beside the drafter's q candidate, each following p exactly; a verifier with the usual
multi-candidate mistake (each branch accepted independently) does not."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.speculative.round import RoundPlan
from hetero_run.runtime.speculative.verifier import RejectionSampler

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


def tree_plan(tokens: list[int], parents: list[int], q=None, model_rows=None) -> RoundPlan:
    return RoundPlan(torch.tensor(tokens, dtype=torch.long), q, start=0, parents=parents, model_rows=model_rows)


def one_hot(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -9.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 9.0
    return logits


class BranchesIndependently(RejectionSampler):
    """The mistake: try each fixed child with probability r(child), independently, in order;
    when none is taken draw the recovered token from r as it was."""

    def _choose(self, r, children):
        for token in children:
            if float(torch.rand((), generator=self.generator)) < float(r[token]):
                return token
        return int(torch.multinomial(r, 1, generator=self.generator)[0])


def test_greedy_takes_the_branch_the_target_agrees_with():
    # rows: 0 root; 1 (3) and 2 (4) children of 0; 3 (5) child of 2; 4 (6) child of 3
    plan = tree_plan([3, 4, 5, 6], [-1, 0, 0, 2, 3])
    verdict = RejectionSampler(GREEDY, None)(plan, one_hot([4, 0, 5, 6, 7]))  # argmax per row
    assert verdict.token_ids == [4, 5, 6, 7] and verdict.rows == [0, 2, 3, 4]
    verdict = RejectionSampler(GREEDY, None)(plan, one_hot([4, 0, 1, 6, 7]))
    assert verdict.token_ids == [4, 1] and verdict.rows == [0, 2]
    verdict = RejectionSampler(GREEDY, None)(plan, one_hot([2, 0, 5, 6, 7]))
    assert verdict.token_ids == [2] and verdict.rows == [0]


def test_greedy_bonus_token_after_a_leaf():
    plan = tree_plan([3, 4], [-1, 0, 0])
    verdict = RejectionSampler(GREEDY, None)(plan, one_hot([3, 1, 2]))
    assert verdict.token_ids == [3, 1] and verdict.rows == [0, 1]


def _first_token_frequencies(sampler_cls, plan_of, logits, trials, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sampler = sampler_cls(SAMPLED, gen)
    counts = Counter()
    for _ in range(trials):
        plan = plan_of(gen)
        counts[sampler(plan, logits).token_ids[0]] += 1
    vocab = logits.shape[-1]
    return torch.tensor([counts[t] for t in range(vocab)], dtype=torch.float32) / trials


LOGITS = torch.tensor([[1.2, 0.9, 0.1, -0.4, 0.6, -1.0]] + [[0.0] * 6] * 4)
P0 = torch.softmax(LOGITS[0], -1)


def test_fixed_candidates_alone_give_p():
    plan = tree_plan([0, 1, 4], [-1, 0, 0, 0])
    freq = _first_token_frequencies(RejectionSampler, lambda gen: plan, LOGITS[:4], 20000)
    torch.testing.assert_close(freq, P0, atol=0.012, rtol=0)


def test_a_q_candidate_and_fixed_candidates_together_give_p():
    """Row 0 holds the drafter's token y ~ q (row 1) and fixed tokens 1 and 4 (rows 2, 3)."""
    q0 = torch.tensor([0.1, 0.5, 0.05, 0.3, 0.05, 0.0])

    def plan_of(gen):
        y = int(torch.multinomial(q0, 1, generator=gen))
        fixed = [t for t in (1, 4) if t != y]
        q = torch.stack([q0, torch.zeros(6)])
        return tree_plan([y] + fixed, [-1, 0] + [0] * len(fixed), q, model_rows=[0, 1])

    freq = _first_token_frequencies(RejectionSampler, plan_of, LOGITS[:4], 20000)
    torch.testing.assert_close(freq, P0, atol=0.012, rtol=0)


def test_independent_branches_are_not_p():
    plan = tree_plan([0, 1, 4], [-1, 0, 0, 0])
    freq = _first_token_frequencies(BranchesIndependently, lambda gen: plan, LOGITS[:4], 20000)
    assert (freq - P0).abs().max() > 0.05


def test_seeded_tree_verification_repeats():
    plan = tree_plan([0, 1, 4, 2], [-1, 0, 0, 0, 1])
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))

    def run(seed):
        sampler = RejectionSampler(SAMPLED, torch.Generator().manual_seed(seed))
        return [sampler(plan, logits).token_ids for _ in range(30)]

    assert run(3) == run(3) and run(3) != run(4)


def test_a_q_row_without_its_node_is_refused():
    q = torch.zeros(3, 6)
    plan = tree_plan([1, 2], [-1, 0, 0], q, model_rows=[0, 1])
    with pytest.raises(ValueError, match="whole chain"):
        RejectionSampler(SAMPLED, torch.Generator().manual_seed(0))(plan, LOGITS[:3])
