"""The rejection sampler with hand-built logits, seeded determinism and distribution checks."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.speculative.round import RoundPlan
from hetero_run.runtime.speculative.verifier import RejectionSampler

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)


def read_emitted(verdict) -> list[int]:
    return verdict.token_ids


def plan(draft: list[int], q: torch.Tensor | None = None) -> RoundPlan:
    return RoundPlan(torch.tensor(draft, dtype=torch.long), q, start=0)


def one_hot_logits(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_perfect_match_accepts_all_and_adds_the_bonus_token():
    verdict = RejectionSampler(GREEDY, None)(plan([1, 2, 3]), one_hot_logits([1, 2, 3, 4]))
    assert verdict.token_ids == [1, 2, 3, 4] and verdict.rows == [0, 1, 2, 3] and verdict.accepted == 3


def test_greedy_early_mismatch_emits_the_recovered_token():
    verdict = RejectionSampler(GREEDY, None)(plan([1, 5, 3]), one_hot_logits([1, 2, 3, 4]))
    assert verdict.token_ids == [1, 2] and verdict.rows == [0, 1]


def test_greedy_first_token_mismatch_and_empty_draft():
    sampler = RejectionSampler(GREEDY, None)
    assert read_emitted(sampler(plan([0, 2]), one_hot_logits([1, 2, 3]))) == [1]
    assert read_emitted(sampler(plan([]), one_hot_logits([4]))) == [4]


def test_greedy_ignores_q():
    q = torch.zeros(3, 6)
    q[:, 0] = 1.0
    assert read_emitted(RejectionSampler(GREEDY, None)(plan([1, 2], q), one_hot_logits([1, 2, 3]))) == [1, 2, 3]


def test_sampled_identical_p_and_q_accept_everything():
    logits = torch.randn(4, 6)
    q = torch.softmax(logits, -1)
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        draft = torch.multinomial(q[:3], 1, generator=gen).flatten().tolist()
        emitted = read_emitted(RejectionSampler(SAMPLED, gen)(plan(draft, q), logits))
        assert emitted[:3] == draft and len(emitted) == 4


def test_sampled_token_outside_p_is_rejected_and_never_recovered():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0, 0.0]])  # p gives token 2 nothing
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    for seed in range(50):
        emitted = read_emitted(RejectionSampler(SAMPLED, torch.Generator().manual_seed(seed))(plan([2], q), logits))
        assert len(emitted) == 1 and emitted[0] != 2


def test_seeded_verification_is_deterministic():
    logits = torch.randn(5, 8)
    q = torch.softmax(torch.randn(5, 8), -1)
    q[-1] = 0
    draft = [1, 2, 3, 4]

    def run(seed):
        return [read_emitted(RejectionSampler(SAMPLED, gen)(plan(draft, q), logits))
                for gen in [torch.Generator().manual_seed(seed)] for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampled_verification_needs_a_generator():
    with pytest.raises(ValueError, match="generator"):
        RejectionSampler(SAMPLED, None)


def _rows(seed: int, n: int, vocab: int, sharp: float = 1.5) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * sharp


@pytest.mark.parametrize("mode", ["rejection", "match"])
def test_emitted_tokens_follow_p_position_by_position(mode):
    """A process whose target distribution at position j is P[j] whatever came before: run
    rounds (drafts from Q) until 3 tokens are out; each position's tokens must follow P[j]."""
    vocab, k, trials = 5, 3, 6000
    target_logits = _rows(0, 6, vocab)
    p = torch.softmax(target_logits, -1)
    q = torch.softmax(_rows(1, 6, vocab), -1)
    gen = torch.Generator().manual_seed(3)
    sampler = RejectionSampler(SAMPLED, gen)
    counts = [Counter() for _ in range(3)]
    for _ in range(trials):
        out: list[int] = []
        while len(out) < 3:
            j = len(out)
            draft = [int(torch.multinomial(q[j + i], 1, generator=gen)) for i in range(k)]
            rows = torch.cat([q[j:j + k], torch.zeros(1, vocab)]) if mode == "rejection" else None
            out += read_emitted(sampler(plan(draft, rows), target_logits[j:j + k + 1]))
        for j in range(3):
            counts[j][out[j]] += 1
    for j in range(3):
        freq = torch.tensor([counts[j][t] for t in range(vocab)], dtype=torch.float32) / trials
        torch.testing.assert_close(freq, p[j], atol=0.02, rtol=0)


def test_a_subprobability_proposal_with_residual_row_is_exact():
    """SLRS's case: the proposer proposes t with probability Q(t) (sum Q < 1) or nothing; with
    nothing, row k holds Q and the token comes from the residual. Together: p exactly."""
    vocab, trials = 4, 20000
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.3]])
    p = torch.softmax(logits, -1)[0]
    psi = torch.tensor([0.5, 0.05, 0.25, 0.0])  # 0.2 proposes nothing
    gen = torch.Generator().manual_seed(0)
    sampler = RejectionSampler(SAMPLED, gen)
    counts = Counter()
    full = torch.cat([psi, torch.tensor([1 - psi.sum()])])
    for _ in range(trials):
        choice = int(torch.multinomial(full, 1, generator=gen))
        if choice == vocab:  # nothing proposed
            emitted = sampler(plan([], psi[None]), logits)
        else:
            emitted = sampler(plan([choice], torch.stack([psi, torch.zeros(vocab)])),
                              torch.cat([logits, torch.zeros(1, vocab)]))
        counts[read_emitted(emitted)[0]] += 1
    freq = torch.tensor([counts[t] for t in range(vocab)], dtype=torch.float32) / trials
    torch.testing.assert_close(freq, p, atol=0.012, rtol=0)
