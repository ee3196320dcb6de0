"""Sampled EAGLE-3 generations follow the target's distribution exactly (TP=1).

The target samples with top-k 3, so its first three tokens take at most 27 values whose exact
probabilities come from the target alone; thousands of seeded speculative generations (the
first token comes from the prompt forward, the next two are the first round's drafts) are
compared with them by a chi-square test, with rejection sampling and with keyed verification
(the default for seeded requests, the head drafting from the same noise). The same test against
a verifier with the textbook bug (recovered tokens drawn from p instead of max(0, p - q)) must
fail.
"""

from __future__ import annotations

import pytest
import torch
from conftest import head_dir, target_dir
from sampling import chi_square_p_value, exact_joint, sample_triples
from test_engine import tokenizer

from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.eagle3 import load_eagle3
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative import verifier
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.verifier import RejectionSampler

RUNS = 1200


class ResidualIsP(RejectionSampler):
    @staticmethod
    def _residual(p_row, q_row):
        return p_row


def build(arch: str, layout: str, verification: str = "rejection"):
    model = load_model(target_dir(arch), max_tokens=64, dtype=torch.float32)
    runner = TargetRunner(model)
    expected = exact_joint(runner, tokenizer(arch)(PROMPT_TEXT)["input_ids"])
    drafter = load_eagle3(head_dir(arch, layout, "aligned"), model, tokenizer(arch))
    engine = SpeculativeEngine(runner, tokenizer(arch), drafter,
                               SpeculationConfig(algorithm="eagle3", draft_len=3, adaptive=False,
                                                 sampled_verification=verification))
    return engine, expected


from sampling import PROMPT as PROMPT_TEXT  # noqa: E402


@pytest.mark.parametrize("verification", ["rejection", "keyed"])
@pytest.mark.parametrize("arch, layout", [("qwen3", "eagle"),
                                          pytest.param("qwen3_moe", "vllm", marks=pytest.mark.slow)])
def test_sampled_tokens_follow_the_target_distribution(arch, layout, verification):
    engine, expected = build(arch, layout, verification)
    counts, acceptance = sample_triples(engine, RUNS)
    assert acceptance > 0.1, "drafts must be accepted often for the test to mean something"
    assert chi_square_p_value(counts, expected, RUNS) > 1e-3, (acceptance, counts.most_common(5))


def test_a_broken_verifier_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(verifier, "RejectionSampler", ResidualIsP)
    engine, expected = build("qwen3", "eagle")
    counts, _ = sample_triples(engine, RUNS)
    assert chi_square_p_value(counts, expected, RUNS) < 1e-6
