"""EAGLE-3 drafting through the speculative engine at TP=1 on tiny qwen3 / qwen3_moe targets
(fp32): greedy output token-identical to the target alone for random and aligned heads in each
layout, with the head's KV cache rolled back and re-run every round."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import head_dir, target_dir
from transformers import AutoTokenizer

from hetero_run.runtime.driver import SpeculativeEngine
from hetero_run.runtime.eagle3 import is_eagle3, load_eagle3
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.topology.errors import ConfigError

PROMPTS = ["def add(a, b):\n", "The cat sat on"]
NEW = 32


@functools.cache
def tokenizer(arch: str):
    return AutoTokenizer.from_pretrained(target_dir(arch))


def setup(arch: str, layout: str, kind: str, algorithm: str = "eagle3", **config):
    model = load_model(target_dir(arch), max_tokens=256, dtype=torch.float32)
    drafter = load_eagle3(head_dir(arch, layout, kind), model, tokenizer(arch))
    runner = TargetRunner(model)
    return SpeculativeEngine(runner, tokenizer(arch), drafter, SpeculationConfig(algorithm=algorithm, **config)), runner


@functools.cache
def reference(arch: str, prompt: str) -> list[int]:
    runner = TargetRunner(load_model(target_dir(arch), max_tokens=256, dtype=torch.float32))
    engine = SpeculativeEngine(runner, tokenizer(arch), None, SpeculationConfig(algorithm="none"))
    return engine.generate(prompt, NEW, stop_ids=set()).token_ids


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("layout", ["eagle", "modelopt", "vllm"])
@pytest.mark.parametrize("kind", ["random", "aligned"])
def test_greedy_output_is_the_target_alones(arch, layout, kind):
    engine, _ = setup(arch, layout, kind)
    drafted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, NEW, stop_ids=set())
        assert result.token_ids == reference(arch, prompt), (arch, layout, kind, prompt)
        drafted += result.drafted
    assert drafted > 0 and set(result.algorithms[:-1]) == {"eagle3"}  # the last: one token left
    if kind == "aligned":  # one draft token a round, so the figure does not depend on measured timings
        engine, _ = setup(arch, layout, kind, adaptive=False, draft_len=1)
        results = [engine.generate(prompt, NEW, stop_ids=set()) for prompt in PROMPTS]
        assert all(r.token_ids == reference(arch, p) for r, p in zip(results, PROMPTS, strict=True))
        accepted, drafted = sum(r.accepted for r in results), sum(r.drafted for r in results)
        assert accepted > 0.2 * drafted, "the aligned head's drafts must be accepted often"


@pytest.mark.parametrize("draft_len", [1, 6])
def test_fixed_draft_lengths_keep_the_head_cache_right(draft_len):
    engine, runner = setup("qwen3", "eagle", "aligned", draft_len=draft_len, adaptive=False, max_draft_len=6)
    drafter = engine.drafter.model
    result = engine.generate(PROMPTS[0], NEW, stop_ids=set())
    assert result.token_ids == reference("qwen3", PROMPTS[0]) and result.accepted > 0
    # every committed token the target has run was (re-)run by the head with the target's states,
    # up to the last round that drafted (a last round with one token left to emit drafts nothing,
    # so the head does not read the round before it)
    committed = runner.length
    unread = draft_len + 1 if result.draft_lengths[-1] == 0 else 0
    assert drafter.exact >= committed - 1 - draft_len - unread
    seen = min(committed, len(drafter.tokens))
    assert seen >= committed - 1 - draft_len - unread
    assert drafter.tokens[:seen] == engine_ids(result, PROMPTS[0])[:seen]


def engine_ids(result, prompt: str) -> list[int]:
    return tokenizer("qwen3")(prompt)["input_ids"] + result.token_ids


def test_head_cache_is_rerun_with_target_states_after_acceptance():
    """Accepted drafts ran with the head's own h; once verified they run again with the target's."""
    engine, runner = setup("qwen3", "eagle", "aligned", draft_len=4, adaptive=False)
    drafter = engine.drafter.model
    calls = []
    forward = drafter.head.forward

    def spy(ids, g):
        calls.append((drafter.head.length, ids.tolist()))
        return forward(ids, g)

    drafter.head.forward = spy
    result = engine.generate(PROMPTS[1], 16, stop_ids=set())
    assert result.accepted > 0
    slots = [slot for slot, ids in calls for _ in ids]
    assert len(slots) > len(set(slots)), "some slots must have been run twice (own h, then target states)"
    assert drafter.exact == runner.length - 1 or drafter.exact >= runner.length - 1 - 4


@pytest.mark.parametrize("algorithm", ["auto", "standard", "slem"])
def test_other_chain_algorithms_and_auto_use_the_head_losslessly(algorithm):
    engine, _ = setup("qwen3_moe", "modelopt", "aligned", algorithm=algorithm)
    if algorithm == "auto":  # the head drafts every other round: rounds without drafting keep the log in step
        engine.config = SpeculationConfig(algorithm="auto", auto_explore_every=2)
        cost, _ = engine.measurements(True)
        cost.elapsed = 1e3  # as if long measured: re-measuring the head is always within budget
    result = engine.generate(PROMPTS[0], NEW, stop_ids=set())
    assert result.token_ids == reference("qwen3_moe", PROMPTS[0])
    if algorithm == "auto":
        assert "eagle3" in set(result.algorithms) and len(set(result.algorithms)) > 1, result.algorithms


def test_algorithm_checks_are_one_line_errors():
    model = load_model(target_dir("qwen3"), max_tokens=64, dtype=torch.float32)
    runner = TargetRunner(model)
    with pytest.raises(ConfigError, match="needs an EAGLE-3 head"):
        from hetero_run.runtime.drafters.fast import FastDraftModel
        from hetero_run.runtime.drafters.load import Drafter

        plain = Drafter(FastDraftModel(load_model(target_dir("qwen3"), max_tokens=64, dtype=torch.float32)),
                        tokenizer("qwen3"), "plain")
        SpeculativeEngine(runner, tokenizer("qwen3"), plain, SpeculationConfig(algorithm="eagle3"))
    drafter = load_eagle3(head_dir("qwen3", "eagle", "random"), model, tokenizer("qwen3"))
    assert is_eagle3(drafter) and not is_eagle3(None)
    for algorithm in ("tli", "slrs"):
        with pytest.raises(ConfigError, match="EAGLE-3 head drafts chains"):
            SpeculativeEngine(runner, tokenizer("qwen3"), drafter, SpeculationConfig(algorithm=algorithm))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_the_batching_engine_drafts_with_the_head_for_one_request_among_others(arch):
    from hetero_run.kernels.sampling import SamplingParams
    from hetero_run.runtime.engine.api import GenerationRequest
    from hetero_run.runtime.engine.engine import EngineConfig, LLMEngine
    from hetero_run.runtime.speculative.prompt import Prompt

    model = load_model(target_dir(arch), max_tokens=256, kv_tokens=2048, dtype=torch.float32)
    drafter = load_eagle3(head_dir(arch, "eagle", "aligned"), model, tokenizer(arch))
    engine = LLMEngine(TargetRunner(model), tokenizer(arch), EngineConfig(max_num_seqs=3), drafter,
                       SpeculationConfig(algorithm="eagle3", adaptive=False, draft_len=1))
    tokens, finals = {}, {}
    prompts = PROMPTS + ["def add(a, b):\n    return"]
    for i, prompt in enumerate(prompts):
        ids = tuple(tokenizer(arch)(prompt)["input_ids"])

        def sink(event, rid=str(i)):
            tokens.setdefault(rid, []).extend(event.token_ids)
            if event.final:
                finals[rid] = event

        engine.add(GenerationRequest(str(i), Prompt(text=prompt, target_ids=ids), NEW, SamplingParams()), sink)
    while engine.has_work():
        engine.step()
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference(arch, prompt), prompt
    spec = finals["0"].speculation  # the first request holds the head's one slot
    assert spec.draft_tokens > 0 and spec.accepted_tokens > 0.2 * spec.draft_tokens
