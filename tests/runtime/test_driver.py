"""The round loop at TP=1 over the real `TargetRunner`: greedy output token-identical to the
target alone (a plain transformers loop) for every algorithm, on tiny trained models whose
tokenizers differ (byte-level BPE target; drafters with `▁` spaces and byte fallback, or with
trailing spaces and no byte fallback)."""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import pytest
import speculative_support as support
import torch
from support import one_thread  # noqa: F401  (autouse: tiny ops run on one thread)

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.topology.errors import ConfigError

PROMPTS = ["def is_prime(n):\n", "The quick brown", "naïve café résumé — 你"]




@functools.cache
def target_model():
    return support.trained_model(support.byte_level(), "qwen2", seed=0)


@functools.cache
def drafter_model(name: str):
    tokenizer = support.byte_level() if name == "same" else support.TOKENIZERS[name]()
    return support.trained_model(tokenizer, "llama", seed=1), tokenizer


def engine(algorithm: str, drafter: str | None, trees: bool = False, **config) -> SpeculativeEngine:
    draft = None
    if drafter is not None:
        model, tokenizer = drafter_model(drafter)
        draft = Drafter(HFDraftModel(model), tokenizer, drafter)
    runner = TargetRunner(load_model(target_model(), max_tokens=512, dtype=torch.float32))
    runner = support.TreeCounter(runner) if trees else support.ChainsOnly(runner)
    return SpeculativeEngine(runner, support.byte_level(), draft, SpeculationConfig(algorithm=algorithm, **config))


@functools.cache
def reference(prompt: str, n: int = 40) -> list[int]:
    return support.reference_greedy(target_model(), support.byte_level()(prompt)["input_ids"], n)


CASES = [(a, d) for d in ("sentencepiece", "trailing_space") for a in ("none", "slem", "tli", "slrs", "auto")]
CASES += [("standard", "same"), ("slem", "same"), ("auto", "same")]


@pytest.mark.parametrize("algorithm, drafter", CASES)
def test_greedy_output_is_the_target_alones(algorithm, drafter):
    eng = engine(algorithm, drafter)
    accepted = 0
    for prompt in PROMPTS:
        result = eng.generate(prompt, max_new_tokens=40, stop_ids=set())
        assert result.token_ids == reference(prompt), (algorithm, drafter, prompt)
        accepted += result.accepted
    if algorithm not in ("none", "auto"):
        assert accepted > 0, "drafts must be accepted for the comparison to mean something"


MODEL_FREE_CASES = [("ngram", None, False, {}), ("suffix", None, False, {}), ("suffix", None, True, {}),
                    ("auto", None, True, {}), ("slem", "sentencepiece", True, {"hybrid": True}),
                    ("tli", "sentencepiece", False, {"hybrid": True}), ("auto", "sentencepiece", True, {}),
                    ("standard", "same", True, {"hybrid": True})]


@pytest.mark.parametrize("algorithm, drafter, trees, options", MODEL_FREE_CASES)
def test_model_free_and_hybrid_rounds_are_the_target_alones(algorithm, drafter, trees, options):
    eng = engine(algorithm, drafter, trees, **options)
    accepted, labels = 0, set()
    for prompt in PROMPTS + [PROMPTS[0]]:  # the repeat finds the first generation in the suffix cache
        result = eng.generate(prompt, max_new_tokens=40, stop_ids=set())
        assert result.token_ids == reference(prompt), (algorithm, drafter, trees, prompt)
        accepted += result.accepted
        labels |= set(result.algorithms)
    assert accepted > 0, labels
    assert eng.trees == trees
    if trees and options.get("hybrid"):
        assert eng.target.tree_forwards > 0, "the rounds must have verified trees"
    if options.get("hybrid"):
        assert any("+" in label for label in labels), labels


@pytest.mark.parametrize("draft_len", [1, 7])
def test_fixed_draft_lengths_are_lossless_too(draft_len):
    eng = engine("slem", "sentencepiece", draft_len=draft_len, adaptive=False)
    result = eng.generate(PROMPTS[0], max_new_tokens=40, stop_ids=set())
    assert result.token_ids == reference(PROMPTS[0]) and set(result.draft_lengths[:-1]) == {draft_len}
    assert result.draft_lengths[-1] in (0, draft_len)  # 0: one token was left to emit, a plain step


def test_chat_prompts_use_each_tokenizers_own_template():
    target_tok = support.byte_level()
    messages = [{"role": "user", "content": "def add(a, b):"}]
    ids = target_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = support.reference_greedy(target_model(), list(ids), 24)
    for drafter in ("sentencepiece", "trailing_space"):  # the second has no chat template
        result = engine("slem", drafter).generate(messages, max_new_tokens=24, stop_ids=set())
        assert result.token_ids == expected
        assert result.prompt_tokens == len(ids)


def test_generation_stops_at_a_stop_token():
    full = reference(PROMPTS[0])
    stop = full[5]
    result = engine("slem", "sentencepiece").generate(PROMPTS[0], max_new_tokens=40, stop_ids={stop})
    assert result.token_ids == full[:full.index(stop) + 1] and result.stop_reason == "stop_token"


def test_seeded_sampling_repeats():
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    outs = [engine("tli", "sentencepiece").generate(PROMPTS[1], 30, sampling, stop_ids=set()).token_ids
            for _ in range(2)]
    assert outs[0] == outs[1]
    others = [engine("tli", "sentencepiece").generate(PROMPTS[1], 30, replace(sampling, seed=seed),
                                                      stop_ids=set()).token_ids for seed in range(6, 12)]
    assert any(other != outs[0] for other in others)  # this tiny target is nearly deterministic at top_p 0.9


def test_round_stats_stream_the_text():
    rounds = []
    result = engine("slem", "sentencepiece").generate(PROMPTS[2], 40, on_round=rounds.append, stop_ids=set())
    assert "".join(r.text for r in rounds) == support.byte_level().decode(result.token_ids)
    assert [t for r in rounds for t in r.token_ids] == result.token_ids
    assert rounds[-1].new_tokens == result.new_tokens and rounds[-1].round == result.rounds
    assert 0 <= rounds[-1].acceptance_rate <= 1 and rounds[-1].tokens_per_second > 0


def test_result_figures_add_up():
    """Every accepted draft token is emitted: a round near the length limit drafts no more than
    the tokens still wanted (else accepted tokens would be verified only to be thrown away)."""
    for limit in (40, 37, 33, 30):
        result = engine("slem", "sentencepiece").generate(PROMPTS[0], limit, stop_ids=set())
        assert result.rounds == len(result.algorithms) == len(result.draft_lengths)
        assert result.new_tokens == limit == 1 + result.rounds + result.accepted  # the prefill gives the first
    assert result.tokens_per_round == pytest.approx(result.new_tokens / result.rounds)
    data = result.to_json()
    assert {"acceptance_rate", "tokens_per_round", "rounds", "token_ids", "text", "seconds"} <= set(data)


def test_auto_logs_every_round_decision(caplog):
    caplog.set_level(logging.DEBUG, logger="hetero_run.runtime.speculative")
    eng = engine("auto", "sentencepiece", auto_explore_every=4)
    result = eng.generate(PROMPTS[0], max_new_tokens=40, stop_ids=set())
    assert result.token_ids == reference(PROMPTS[0])
    decisions = [r.message for r in caplog.records if r.message.startswith("round ")]
    assert len(decisions) == result.rounds and all("->" in d and "tok/s" in d for d in decisions)


def test_auto_keeps_its_measurements_from_prompt_to_prompt():
    eng = engine("auto", "sentencepiece")
    eng.generate(PROMPTS[0], max_new_tokens=40, stop_ids=set())
    cost, _ = eng.measured[True]
    rounds, measured = cost.rounds, dict(cost.verify.by_rows)
    second = eng.generate(PROMPTS[1], max_new_tokens=40, stop_ids=set())
    assert eng.measured[True][0] is cost and cost.rounds == rounds + second.rounds
    assert measured and set(measured) <= set(cost.verify.by_rows)
    assert second.token_ids == reference(PROMPTS[1])


@pytest.mark.parametrize("algorithm, drafter, message", [
    ("standard", "sentencepiece", "vocabulary"),
    ("slem", None, "needs a drafter"),
])
def test_impossible_algorithms_are_one_line_errors(algorithm, drafter, message):
    with pytest.raises(ConfigError, match=message):
        engine(algorithm, drafter)
    with pytest.raises(ConfigError, match="unknown algorithm"):
        SpeculationConfig(algorithm="eagle")
