"""Speculation inside the batching engine: drafted rows ride in the step beside other requests'
rows, and every request's greedy output stays the target alone's, for every algorithm."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import speculative_support as support
import torch

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.engine.api import GenerationRequest
from hetero_run.runtime.engine.engine import EngineConfig, LLMEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.prompt import Prompt

PROMPTS = ["def is_prime(n):\n", "The quick brown", "naïve café résumé — 你", "Hello world! Hello"]
NEW = 30


@functools.cache
def target_model():
    return support.trained_model(support.byte_level(), "qwen2", seed=0)


@functools.cache
def drafter_model(name: str):
    tokenizer = support.byte_level() if name == "same" else support.TOKENIZERS[name]()
    return support.trained_model(tokenizer, "llama", seed=1), tokenizer


@functools.cache
def reference(prompt: str) -> tuple[int, ...]:
    return tuple(support.reference_greedy(target_model(), support.byte_level()(prompt)["input_ids"], NEW))


def _engine(algorithm, drafter, **config):
    model, tokenizer = drafter_model(drafter)
    runner = TargetRunner(load_model(target_model(), max_tokens=256, kv_tokens=1024, dtype=torch.float32,
                                     block_size=8))
    spec = SpeculationConfig(algorithm=algorithm, **config)
    return LLMEngine(runner, support.byte_level(), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64),
                     Drafter(HFDraftModel(model), tokenizer, drafter), spec)


def _request(i, prompt):
    ids = support.byte_level()(prompt)["input_ids"]
    return GenerationRequest(f"r{i}", Prompt(text=prompt, target_ids=tuple(ids)), NEW, SamplingParams())


@pytest.mark.parametrize("algorithm, drafter", [("slem", "sentencepiece"), ("tli", "trailing_space"),
                                                ("standard", "same"), ("auto", "sentencepiece")])
def test_speculating_among_other_requests_keeps_every_output_the_targets(algorithm, drafter, monkeypatch):
    from hetero_run.runtime.speculative.cost import CostModel

    priced = []  # auto: each round's rows are priced as a share of the step it joins
    choose = CostModel.choose
    monkeypatch.setattr(CostModel, "choose", lambda self, *a, **kw: priced.append(kw.get("verify")) or
                        choose(self, *a, **kw))
    engine = _engine(algorithm, drafter)
    tokens, finals = {}, {}

    def sink_for(rid):
        def sink(event):
            tokens.setdefault(rid, []).extend(event.token_ids)
            if event.final:
                finals[rid] = event
        return sink

    for i, prompt in enumerate(PROMPTS):
        engine.add(_request(i, prompt), sink_for(f"r{i}"))
    while engine.has_work():
        engine.step()
    for i, prompt in enumerate(PROMPTS):
        assert tuple(tokens[f"r{i}"]) == reference(prompt), (algorithm, prompt)
    if algorithm != "auto":
        assert sum(f.speculation.draft_tokens for f in finals.values()) > 0
    else:
        assert priced and all(verify is not None for verify in priced)
    for final in finals.values():  # acceptance by depth: each accepted token counted once, depth 1 the most
        s = final.speculation
        assert sum(s.accepted_per_position) == s.accepted_tokens
        assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)
        assert not s.accepted_per_position or 0 < s.accepted_per_position[0] <= s.drafts
    assert engine.speculation.free_slots == 1, "the drafter slot came back"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_every_request_drafts_on_its_own_slot_and_stays_the_targets():
    from hetero_run.runtime.drafters.hf import HFDraftNetwork

    model, tokenizer = drafter_model("sentencepiece")
    runner = TargetRunner(load_model(target_model(), max_tokens=256, kv_tokens=1024, dtype=torch.float32,
                                     block_size=8))
    drafter = Drafter(None, tokenizer, "sentencepiece", HFDraftNetwork(model, slots=4, max_tokens=256))
    engine = LLMEngine(runner, support.byte_level(), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64),
                       drafter, SpeculationConfig(algorithm="slem", adaptive=False, draft_len=3))
    tokens, finals = {}, {}
    for i, prompt in enumerate(PROMPTS):
        def sink(event, rid=f"r{i}"):
            tokens.setdefault(rid, []).extend(event.token_ids)
            if event.final:
                finals[rid] = event
        engine.add(_request(i, prompt), sink)
    assert drafter.network.free_slots == 4
    while engine.has_work():
        engine.step()
        assert drafter.network.free_slots >= 4 - engine.num_running
    for i, prompt in enumerate(PROMPTS):
        assert tuple(tokens[f"r{i}"]) == reference(prompt), prompt
        assert finals[f"r{i}"].speculation.draft_tokens > 0, prompt  # each had a slot of its own
    assert drafter.network.free_slots == 4 and engine.speculation.free_slots == 4


def _run(engine, requests) -> dict[str, tuple[int, ...]]:
    tokens: dict[str, list[int]] = {}
    for request in requests:
        engine.add(request, lambda event, rid=request.request_id: tokens.setdefault(rid, []).extend(event.token_ids))
    while engine.has_work():
        engine.step()
    return {rid: tuple(ids) for rid, ids in tokens.items()}


@pytest.mark.parametrize("algorithm, drafter", [("tli", "sentencepiece"), ("standard", "same"),
                                                ("auto", "sentencepiece")])
def test_a_seeded_sampled_request_among_others_returns_what_it_returns_alone(algorithm, drafter):
    """Keyed verification: each token's draw depends on (seed, position) only, so neither the
    other requests (smaller drafts under load) nor the algorithm change a seeded request."""
    from hetero_run.launch.generate import TargetOnly

    sampling = [SamplingParams(temperature=1.0, seed=seed) for seed in (3, 4, 5, 6)]
    requests = [GenerationRequest(f"r{i}", _request(i, prompt).prompt, NEW, params)
                for i, (prompt, params) in enumerate(zip(PROMPTS, sampling, strict=True))]
    together = _run(_engine(algorithm, drafter), requests)
    runner = TargetRunner(load_model(target_model(), max_tokens=256, dtype=torch.float32))
    for request in requests:
        alone = _run(_engine(algorithm, drafter), [request])[request.request_id]
        assert together[request.request_id] == alone, request.request_id
        target = TargetOnly(runner, request.sampling)
        plain = [t for ids in target.tokens(list(request.prompt.target_ids), NEW, set()) for t in ids]
        assert alone == tuple(plain), request.request_id  # the target alone, same seed
    assert len(set(together.values())) == len(requests)


def test_where_proposing_served_slower_the_steps_do_not_propose():
    """engine.speculation: the steps of a band of deciding sequences where drafting was measured
    slower than not drafting skip the proposers until PROBE_EVERY steps have passed without a draft,
    so at most one step in PROBE_EVERY drafts, and the output is still the target's."""
    from hetero_run.runtime.engine.speculation import ProposingOutcome, load_band

    engine = _engine("auto", "sentencepiece")
    spec = engine.speculation
    for deciding in range(1, 5):  # as if measured: proposing 1 s a token, plain steps 0.1 ms
        for _ in range(ProposingOutcome.MIN_STEPS):
            spec.outcome.record(deciding, True, 1.0, 1)
            spec.outcome.record(deciding, False, 1e-4, 1)
    steps: dict[int, list[bool]] = {}
    measured = spec.measured_step

    def spy(rows, seconds, tokens):
        steps.setdefault(spec.deciding, []).append(spec.step_drafted)
        measured(rows, seconds, tokens)

    spec.measured_step = spy
    tokens = _run(engine, [_request(i, prompt) for i, prompt in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"r{i}"] == reference(prompt), prompt
    assert sum(len(v) for v in steps.values()) >= NEW // 2
    bands: dict[int, list[bool]] = {}
    for deciding, proposed in steps.items():
        bands.setdefault(load_band(deciding), []).extend(proposed)
    for band, drafted in bands.items():
        assert sum(drafted) <= len(drafted) // ProposingOutcome.PROBE_EVERY + 1, (band, drafted)


@pytest.mark.parametrize("explore", [True, False])
def test_a_step_table_that_prices_rows_too_high_is_measured_again(explore, monkeypatch):
    """engine.speculation: alone, a step table whose multi-row figures are far too high (one slow
    step) keeps every round from drafting, so those figures are never measured again; after
    PROBE_EVERY steps without a draft row one step prices rows at the prior's share, a round
    drafts, and the table holds a real figure. Without that (explore=False) nothing drafts."""
    from hetero_run.runtime.engine import speculation

    if not explore:
        monkeypatch.setattr(speculation, "EXPLORE_BANDS", ())
    engine = _engine("auto", "sentencepiece")
    spec = engine.speculation
    for _ in range(3):  # as if one warm-up step of 3 rows had taken a second
        spec.step_seconds.record(1, 0.002)
        spec.step_seconds.record(3, 1.0)
    # and the drafter measured cheap on earlier requests: the exploring step's round has a
    # candidate whatever the text offers the model-free proposers
    cost, _ = spec.shared.measurements(True)
    for _ in range(200):
        cost.record_draft(1, 1e-5, 10, 1e-6, 1)
    finals = {}
    tokens = []

    def sink(event):
        tokens.extend(event.token_ids)
        if event.final:
            finals["r0"] = event

    engine.add(_request(0, PROMPTS[0]), sink)
    while engine.has_work():
        engine.step()
    assert tuple(tokens) == reference(PROMPTS[0])
    drafted = finals["r0"].speculation.draft_tokens
    if explore:
        assert drafted > 0
        assert any(rows > 1 and rows != 3 for rows in spec.step_seconds.by_rows), sorted(spec.step_seconds.by_rows)
    else:
        assert drafted == 0


@pytest.mark.parametrize("algorithm, drafter", [("slem", "sentencepiece"), ("standard", "same"),
                                                ("auto", "sentencepiece")])
def test_log_probabilities_under_speculation_are_the_target_alones(algorithm, drafter):
    """Each token's log-probability (and the top 5) comes from the target row that decided it: with
    drafts verified beside other requests they are the figures of the engine without speculation,
    bit for bit, and those are the target's own (a plain forward over prompt + output)."""
    top = 5

    def collect(engine, requests):
        events: dict[str, list] = {}
        for request in requests:
            engine.add(request, lambda event, rid=request.request_id: events.setdefault(rid, []).append(event))
        while engine.has_work():
            engine.step()
        return events

    requests = [replace(_request(i, prompt), logprobs=top) for i, prompt in enumerate(PROMPTS)]
    speculative = collect(_engine(algorithm, drafter), requests)
    runner = TargetRunner(load_model(target_model(), max_tokens=256, kv_tokens=1024, dtype=torch.float32,
                                     block_size=8))
    plain = collect(LLMEngine(runner, support.byte_level(), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64)),
                    requests)
    drafted = 0
    for request in requests:
        rid = request.request_id
        entries = [e for event in speculative[rid] for e in event.logprobs]
        tokens = [t for event in speculative[rid] for t in event.token_ids]
        assert entries == [e for event in plain[rid] for e in event.logprobs], (algorithm, rid)
        assert [e.token_id for e in entries] == tokens == list(reference(request.prompt.text))
        drafted += speculative[rid][-1].speculation.draft_tokens
        prompt = list(request.prompt.target_ids)
        with torch.no_grad():
            logits = target_model()(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        for j, e in enumerate(entries):
            assert len(e.top) == top and e.top[0][0] == e.token_id and e.top[0][1] == e.logprob  # greedy: the likeliest
            assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
            assert abs(e.logprob - float(expected[j, e.token_id])) < 1e-4, (rid, j)
            ids = [i for i, _ in e.top]
            assert torch.allclose(torch.tensor([lp for _, lp in e.top]), expected[j, ids], atol=1e-4)
    if algorithm != "auto":
        assert drafted > 0
