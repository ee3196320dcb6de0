"""Draft length from measured acceptance and cost."""

from __future__ import annotations

import random

from hetero_run.runtime.speculative.adaptive import DraftLength
from hetero_run.runtime.speculative.config import SpeculationConfig


def simulate(alpha: float, draft_unit_s: float, verify_s: float, rounds: int = 80, seed: int = 0) -> int:
    """Rounds whose units are kept with probability alpha; -> the draft length settled on."""
    rnd = random.Random(seed)
    lengths = DraftLength(SpeculationConfig(draft_len=4, max_draft_len=12))
    for _ in range(rounds):
        k = lengths.next()
        kept = 0
        while kept < k and rnd.random() < alpha:
            kept += 1
        lengths.record(k, kept, k + 1, kept + 1, draft_unit_s * k, verify_s * (1 + 0.02 * k))
    return lengths.k


def test_high_acceptance_and_cheap_drafts_draft_long():
    assert simulate(alpha=0.9, draft_unit_s=0.002, verify_s=0.05) >= 8


def test_low_acceptance_drafts_short():
    assert simulate(alpha=0.2, draft_unit_s=0.01, verify_s=0.05) <= 2


def test_expensive_drafts_draft_shorter_than_cheap_ones():
    assert simulate(alpha=0.8, draft_unit_s=0.03, verify_s=0.05) < simulate(alpha=0.8, draft_unit_s=0.002,
                                                                             verify_s=0.05)


def test_fixed_length_when_not_adaptive():
    lengths = DraftLength(SpeculationConfig(draft_len=5, adaptive=False))
    for _ in range(20):
        assert lengths.next() == 5
        lengths.record(5, 0, 6, 1, 0.5, 0.05)
