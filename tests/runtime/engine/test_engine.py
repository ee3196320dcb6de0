"""The batching engine (runtime/engine/engine.py) on tiny models at TP=1: requests served together
return exactly what each returns alone (greedy and seeded sampling), prefix caching reuses blocks
and reports them, preemption recomputes exactly, cancellation frees everything, nothing leaks."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_checkpoint, tiny_tokenizer

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.engine.api import GenerationRequest
from hetero_run.runtime.engine.engine import EngineConfig, LLMEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.prompt import Prompt
from hetero_run.topology.errors import UserError


@pytest.fixture(scope="module")
def target():
    path = tiny_checkpoint("qwen3", "nvfp4")
    return path, tiny_tokenizer()


def _runner(path, kv_tokens=2048, block_size=4):
    model = load_model(path, dtype=torch.bfloat16, max_tokens=256, kv_tokens=kv_tokens, block_size=block_size)
    return TargetRunner(model)


def _request(i, ids, new=12, sampling=None, stop_strings=()):
    return GenerationRequest(f"r{i}", Prompt(target_ids=tuple(ids)), new, sampling or SamplingParams(),
                             stop_strings=tuple(stop_strings))


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 300) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


class Collect:
    def __init__(self):
        self.events = {}

    def sink_for(self, rid):
        return lambda event: self.events.setdefault(rid, []).append(event)

    def tokens(self, rid):
        return [t for e in self.events[rid] for t in e.token_ids]

    def final(self, rid):
        finals = [e for e in self.events[rid] if e.final]
        assert len(finals) == 1 and self.events[rid][-1] is finals[0]
        return finals[0]


def _serve(engine, requests):
    out = Collect()
    for r in requests:
        engine.add(r, out.sink_for(r.request_id))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        assert steps < 5000
    return out


def _alone(path, tokenizer, request):
    engine = LLMEngine(_runner(path), tokenizer, EngineConfig(max_num_seqs=1, enable_prefix_caching=False))
    return _serve(engine, [request]).tokens(request.request_id)


def _reference_greedy(runner, ids, new):
    runner.truncate(0)
    logits = runner.forward(torch.tensor(ids), torch.arange(len(ids)), num_logits=1)
    out = []
    for i in range(new):
        token = int(logits[0].argmax())
        out.append(token)
        logits = runner.forward(torch.tensor([token]), torch.tensor([len(ids) + i]))
    return out


def test_one_request_equals_plain_greedy_decoding(target):
    path, tokenizer = target
    ids = _prompts(1, seed=3)[0]
    got = _alone(path, tokenizer, _request(0, ids, new=16))
    assert got == _reference_greedy(_runner(path), ids, 16)


def test_requests_served_together_return_what_each_returns_alone(target):
    path, tokenizer = target
    prompts = _prompts(6, seed=1)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    requests = [_request(i, p, new=10 + i, sampling=sampled if i % 2 else None) for i, p in enumerate(prompts)]
    engine = LLMEngine(_runner(path), tokenizer, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24))
    together = _serve(engine, requests)
    for r in requests:
        assert together.tokens(r.request_id) == _alone(path, tokenizer, r), r.request_id
        final = together.final(r.request_id)
        assert final.finish_reason == "length" and final.usage.completion_tokens == r.max_new_tokens
        assert final.usage.prompt_tokens == r.prompt_tokens
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_shared_prefix_comes_from_the_cache_and_changes_nothing(target):
    path, tokenizer = target
    system = _prompts(1, seed=5)[0] * 2  # 30-80 tokens both requests share
    first, second = system + [11, 12, 13], system + [21, 22]
    engine = LLMEngine(_runner(path), tokenizer, EngineConfig(max_num_seqs=2))
    a = _serve(engine, [_request(0, first)])
    b = _serve(engine, [_request(1, second)])
    cached = b.final("r1").usage.cached_tokens
    assert a.final("r0").usage.cached_tokens == 0
    assert cached == len(system) // 4 * 4 and cached > 0
    assert b.tokens("r1") == _alone(path, tokenizer, _request(1, second))
    # a second turn: the first turn's prompt and answer are reused
    turn2 = first + a.tokens("r0") + [30, 31]
    c = _serve(engine, [_request(2, turn2)])
    assert c.final("r2").usage.cached_tokens >= (len(first) + len(a.tokens("r0")) - 1) // 4 * 4
    assert c.tokens("r2") == _alone(path, tokenizer, _request(2, turn2))


def test_running_out_of_blocks_preempts_and_recomputes_exactly(target):
    path, tokenizer = target
    prompts = _prompts(5, seed=9)
    requests = [_request(i, p, new=24) for i, p in enumerate(prompts)]
    engine = LLMEngine(_runner(path, kv_tokens=96, block_size=4), tokenizer,
                       EngineConfig(max_num_seqs=5, max_num_batched_tokens=32, enable_prefix_caching=False))
    out = _serve(engine, requests)
    assert engine.scheduler.preemptions > 0
    for r in requests:
        assert out.tokens(r.request_id) == _alone(path, tokenizer, r), r.request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_cancel_frees_the_request_and_the_others_go_on(target):
    path, tokenizer = target
    prompts = _prompts(3, seed=4)
    requests = [_request(i, p, new=30) for i, p in enumerate(prompts)]
    engine = LLMEngine(_runner(path), tokenizer, EngineConfig(max_num_seqs=3))
    out = Collect()
    for r in requests:
        engine.add(r, out.sink_for(r.request_id))
    for _ in range(4):
        engine.step()
    engine.cancel("r1")
    while engine.has_work():
        engine.step()
    assert out.final("r1").finish_reason == "abort" and len(out.tokens("r1")) < 30
    for r in (requests[0], requests[2]):
        assert out.tokens(r.request_id) == _alone(path, tokenizer, r)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_stop_tokens_and_impossible_requests(target):
    path, tokenizer = target
    ids = _prompts(1, seed=3)[0]
    plain = _alone(path, tokenizer, _request(0, ids, new=16))
    stop = plain[5]
    request = GenerationRequest("s", Prompt(target_ids=tuple(ids)), 16, SamplingParams(), stop_ids=frozenset({stop}))
    engine = LLMEngine(_runner(path), tokenizer)
    out = _serve(engine, [request])
    assert out.tokens("s") == plain[:plain.index(stop) + 1] and out.final("s").finish_reason == "stop"
    with pytest.raises(UserError, match="exceed the context of 256 tokens"):
        engine.add(_request(9, ids, new=256), lambda e: None)
    with pytest.raises(UserError, match="the prompt is empty"):
        engine.add(_request(8, [], new=2), lambda e: None)


def test_prompt_log_probabilities_over_chunks_and_past_the_prefix_cache(target):
    """A prompt's log-probabilities (echo with logprobs) come from its own rows, read chunk by chunk:
    the target's figures for every prompt token from the second on; a second request for the same
    prompt computes them again rather than taking the cached blocks (equal bit for bit), while a
    request that does not ask still reuses the cache; with preemption nothing is counted twice."""
    path, tokenizer = target
    ids = _prompts(1, seed=11)[0] * 3  # 9-117 tokens: several chunks of 16
    top = 3
    engine = LLMEngine(_runner(path), tokenizer, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16))

    def ask(i, prompt_logprobs=top):
        request = replace(_request(i, ids, new=4), prompt_logprobs=prompt_logprobs)
        out = _serve(engine, [request])
        firsts = [e for e in out.events[request.request_id] if e.prompt_logprobs]
        return out, firsts

    a, firsts = ask(0)
    assert len(firsts) == 1 and firsts[0].token_ids  # once, with the first output token
    entries = firsts[0].prompt_logprobs
    assert [e.token_id for e in entries] == ids[1:]
    runner = _runner(path)
    logits = runner.forward(torch.tensor(ids), torch.arange(len(ids)), num_logits=len(ids)).float()
    expected = torch.log_softmax(logits[:-1], dim=-1)
    for q, e in enumerate(entries):
        assert abs(e.logprob - float(expected[q, ids[q + 1]])) < 1e-5
        assert [i for i, _ in e.top] == expected[q].topk(top).indices.tolist()
    b, again = ask(1)
    assert again[0].prompt_logprobs == entries and b.final("r1").usage.cached_tokens == 0
    c, none = ask(2, prompt_logprobs=None)
    assert not none and c.final("r2").usage.cached_tokens > 0
    assert a.tokens("r0") == b.tokens("r1") == c.tokens("r2")
    # two requests in too few blocks: one is preempted mid-prompt or mid-answer and recomputed
    small = LLMEngine(_runner(path, kv_tokens=len(ids) + 24, block_size=4), tokenizer,
                      EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, enable_prefix_caching=False))
    requests = [replace(_request(i, ids, new=12), prompt_logprobs=top) for i in (3, 4)]
    out = _serve(small, requests)
    assert small.scheduler.preemptions > 0
    for r in requests:
        got = [e for event in out.events[r.request_id] for e in event.prompt_logprobs]
        assert got == list(entries), r.request_id


def test_the_same_prompt_arriving_twice_at_once_is_computed_once(target):
    """Two requests for one prompt (n choices, a system prompt of a burst) submitted together: the
    second waits while the first computes the shared blocks, then takes them from the cache; a
    request behind them with another prompt still runs; every output is what it is alone."""
    path, tokenizer = target
    ids = _prompts(1, seed=13)[0] * 3 + [7]
    other = _prompts(1, seed=14)[0]
    # a budget that holds both prompts: without waiting, the second would be computed beside the first
    engine = LLMEngine(_runner(path), tokenizer, EngineConfig(max_num_seqs=3, max_num_batched_tokens=2 * len(ids)))
    requests = [_request(0, ids), _request(1, ids), _request(2, other)]
    out = _serve(engine, requests)
    assert out.final("r0").usage.cached_tokens == 0
    assert out.final("r1").usage.cached_tokens == (len(ids) - 1) // 4 * 4 > 0
    for r in requests:
        assert out.tokens(r.request_id) == _alone(path, tokenizer, r), r.request_id
    assert engine.blocks.num_free == engine.blocks.num_blocks
