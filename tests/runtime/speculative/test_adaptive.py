"""Draft length from measured acceptance and cost; `auto` keeps the fastest measured candidate."""

from __future__ import annotations

import logging
import random

from hetero_run.runtime.speculative.adaptive import DraftLength
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.selector import Selector


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


def test_auto_keeps_the_fastest_and_logs_every_decision(caplog):
    caplog.set_level(logging.INFO, logger="hetero_run")
    speeds = {"slem": 30.0, "tli": 20.0, "none": 10.0}  # tokens per second
    config = SpeculationConfig(auto_probe_rounds=3, auto_reprobe_every=10)
    selector = Selector(["tli", "slem", "none"], config, auto=True)
    seen = []
    for _ in range(40):
        name = selector.current()
        seen.append(name)
        selector.record(name, 3, 3 / speeds[name])
    assert seen[:9] == ["tli"] * 3 + ["slem"] * 3 + ["none"] * 3
    assert seen[9:19] == ["slem"] * 10  # the fastest runs alone
    assert "tli" in seen[19:] and "none" in seen[19:]  # then the others are measured again
    decisions = [r.message for r in caplog.records if "auto: measured" in r.message]
    assert decisions[0].endswith("-> slem") and "slem 30.00 tok/s" in decisions[0]
    assert any("re-measuring" in r.message for r in caplog.records)


def test_auto_follows_a_change_in_speed():
    config = SpeculationConfig(auto_probe_rounds=4, auto_reprobe_every=8)
    selector = Selector(["slem", "none"], config, auto=True)
    for i in range(200):
        name = selector.current()
        slem_speed = 30.0 if i < 60 else 5.0  # the text turns hard to draft
        selector.record(name, 3, 3 / (slem_speed if name == "slem" else 10.0))
    assert selector.best == "none"
