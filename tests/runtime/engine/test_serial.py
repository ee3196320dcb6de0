"""runtime/engine/serial.py: arrival order, the bounded queue, cancellation within one round,
stop strings, failures, drain; on a scripted decoder, then on the real target alone and the
real speculative engine over tiny models."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import torch

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.engine.api import EngineState, EngineUnavailable, GenerationRequest, QueueFull
from hetero_run.runtime.engine.meter import RoundMeter
from hetero_run.runtime.engine.serial import SerialEngine
from hetero_run.runtime.speculative.prompt import Prompt
from hetero_run.topology.errors import UserError

VOCAB = {i: chr(ord("a") + i) for i in range(26)}


def letters(ids) -> str:
    return "".join(VOCAB[i] for i in ids)


class FakeTarget:
    """A KV cache that only counts: what the meter and the engine see of a runner."""

    def __init__(self, max_tokens=1000):
        self.length, self.max_tokens, self.forwards = 0, max_tokens, 0

    def forward(self, ids, positions, num_logits=None):
        self.length += int(ids.shape[0])
        self.forwards += 1

    def truncate(self, length):
        assert 0 <= length <= self.length
        self.length = length


class ScriptedDecoder:
    """Drives the target like a speculative decoder: prompt forward, then rounds of [last] + k
    draft tokens keeping `accept + 1`; emits letters cycling through the alphabet."""

    algorithm = "scripted"

    def __init__(self, target, k=3, accept=1, round_s=0.0, fail_at=None):
        self.target, self.k, self.accept, self.round_s, self.fail_at = target, k, accept, round_s, fail_at
        self.sampling = None
        self.rounds_run = 0
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def generate(self, prompt, max_new_tokens, stop_ids, on_tokens):
        self.started.set()
        self.release.wait(10)
        n = len(prompt.target_ids)
        self.target.truncate(0)
        self.target.forward(torch.zeros(n), torch.arange(n), num_logits=1)
        made = []
        while len(made) < max_new_tokens:
            if self.fail_at is not None and len(made) >= self.fail_at:
                self.fail_at = None
                raise self.error
            start = self.target.length
            self.target.forward(torch.zeros(self.k + 1), torch.arange(self.k + 1))
            self.target.truncate(start + self.accept + 1)
            new = [(len(made) + i) % 26 for i in range(self.accept + 1)][: max_new_tokens - len(made)]
            made += new
            self.rounds_run += 1
            time.sleep(self.round_s)
            on_tokens(new)
            if new[-1] in stop_ids:
                break
        return {}


def request(rid, prompt_len=4, max_new=10, stops=(), stop_ids=frozenset()):
    return GenerationRequest(rid, Prompt(target_ids=tuple(range(prompt_len))), max_new, SamplingParams(),
                             frozenset(stop_ids), tuple(stops))


class Collector:
    def __init__(self):
        self.events = queue.Queue()
        self.by_id: dict[str, list] = {}

    def sink(self, event):
        self.by_id.setdefault(event.request_id, []).append(event)
        self.events.put(event)

    def final(self, rid, timeout=10.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            events = self.by_id.get(rid, [])
            if events and events[-1].final:
                return events[-1]
            time.sleep(0.005)
        raise AssertionError(f"{rid} did not finish: {self.by_id.get(rid)}")

    def text(self, rid):
        return "".join(e.text for e in self.by_id[rid])


@pytest.fixture
def setup():
    engines = []

    def make(max_queue=8, **decoder_kw):
        target = FakeTarget()
        meter = RoundMeter(target)
        decoder = ScriptedDecoder(meter, **decoder_kw)
        engine = SerialEngine(max_queue=max_queue)
        engine.start(decoder, meter, letters, max_context=target.max_tokens)
        engines.append((engine, decoder))
        return engine, decoder, target, Collector()

    yield make
    for engine, decoder in engines:
        decoder.release.set()
        engine.shutdown(timeout=5)


def test_requests_run_in_arrival_order_each_ending_with_one_final_event(setup):
    engine, decoder, target, out = setup()
    decoder.release.clear()
    for i in range(4):
        engine.submit(request(f"r{i}", max_new=6), out.sink)
    decoder.release.set()
    finals = [out.final(f"r{i}") for i in range(4)]
    order = []
    while not out.events.empty():
        e = out.events.get()
        if not order or order[-1] != e.request_id:
            order.append(e.request_id)
    assert order == ["r0", "r1", "r2", "r3"]  # one after another, never interleaved
    for i, final in enumerate(finals):
        events = out.by_id[f"r{i}"]
        assert [e.final for e in events] == [False] * (len(events) - 1) + [True]
        assert final.finish_reason == "length" and out.text(f"r{i}") == "abcdef"
        assert sum(len(e.token_ids) for e in events) == 6 == final.usage.completion_tokens
        assert final.usage.prompt_tokens == 4
    assert target.length == 0  # the KV cache is empty after every request


def test_speculation_summary_counts_rounds_drafts_and_accepted_tokens(setup):
    engine, _, _, out = setup()
    engine.submit(request("r", max_new=8), out.sink)
    spec = out.final("r").speculation
    # prompt forward + 4 verify rounds of k=3 keeping 2 tokens (1 accepted) each
    assert (spec.rounds, spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (5, 4, 12, 4)
    assert spec.algorithm == "scripted" and spec.tokens_per_round == pytest.approx(9 / 5)


def test_the_queue_is_bounded(setup):
    engine, decoder, _, out = setup(max_queue=2)
    decoder.release.clear()
    engine.submit(request("running"), out.sink)
    assert decoder.started.wait(5)
    engine.submit(request("w1"), out.sink)
    engine.submit(request("w2"), out.sink)
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        engine.submit(request("w3"), out.sink)
    assert engine.stats().running == 1 and engine.stats().waiting == 2
    decoder.release.set()
    for rid in ("running", "w1", "w2"):
        assert out.final(rid).finish_reason == "length"
    assert "w3" not in out.by_id


def test_cancel_stops_a_running_request_within_one_round_and_frees_its_cache(setup):
    engine, decoder, target, out = setup(round_s=0.02)
    engine.submit(request("r", max_new=500), out.sink)
    while decoder.rounds_run < 3:
        time.sleep(0.005)
    engine.cancel("r")
    at_cancel = decoder.rounds_run
    final = out.final("r")
    assert final.finish_reason == "abort"
    assert decoder.rounds_run <= at_cancel + 1
    assert target.length == 0
    engine.submit(request("next", max_new=3), out.sink)  # and the engine goes on
    assert out.final("next").finish_reason == "length" and out.text("next") == "abc"


def test_cancel_of_a_queued_request_ends_it_at_once(setup):
    engine, decoder, _, out = setup()
    decoder.release.clear()
    engine.submit(request("running"), out.sink)
    assert decoder.started.wait(5)
    engine.submit(request("queued"), out.sink)
    engine.cancel("queued")
    assert out.final("queued", timeout=1).finish_reason == "abort"
    assert engine.stats().waiting == 0
    decoder.release.set()
    assert out.final("running").finish_reason == "length"
    assert len(out.by_id["queued"]) == 1


def test_a_stop_string_ends_generation_in_the_round_it_appears(setup):
    engine, decoder, target, out = setup()
    engine.submit(request("r", max_new=100, stops=("fg",)), out.sink)
    final = out.final("r")
    assert final.finish_reason == "stop" and out.text("r") == "abcde"
    assert decoder.rounds_run == 4  # "gh" arrived in round 4: nothing after it ran
    assert final.usage.completion_tokens == 8 and target.length == 0


def test_an_end_of_sequence_token_finishes_with_stop(setup):
    engine, _, _, out = setup()
    engine.submit(request("r", max_new=100, stop_ids={5}), out.sink)
    assert out.final("r").finish_reason == "stop" and out.final("r").usage.completion_tokens == 6


def test_a_user_error_ends_that_request_only(setup):
    engine, decoder, target, out = setup(fail_at=2)
    decoder.error = UserError("the sequence would reach 99 tokens", field="max_tokens")
    engine.submit(request("bad"), out.sink)
    engine.submit(request("good", max_new=2), out.sink)
    bad = out.final("bad")
    assert bad.finish_reason == "error" and "would reach 99 tokens" in bad.error
    assert out.final("good").finish_reason == "length" and engine.state is EngineState.READY
    assert target.length == 0


def test_any_other_error_fails_the_engine_and_every_request(setup):
    engine, decoder, _, out = setup(fail_at=2)
    engine.describe_failure = lambda exc: f"rank 1 stopped responding: {exc}"
    decoder.error = RuntimeError("Connection reset by peer")
    decoder.release.clear()
    engine.submit(request("running"), out.sink)
    engine.submit(request("queued"), out.sink)
    decoder.release.set()
    for rid in ("running", "queued"):
        final = out.final(rid)
        assert final.finish_reason == "error" and final.error == "rank 1 stopped responding: Connection reset by peer"
    assert engine.state is EngineState.FAILED and "rank 1" in engine.error
    with pytest.raises(EngineUnavailable, match="rank 1 stopped responding"):
        engine.submit(request("late"), out.sink)


def test_fail_from_another_thread_ends_requests_while_the_engine_is_stuck(setup):
    engine, decoder, _, out = setup()
    decoder.release.clear()  # the engine's thread is blocked, as in a collective that never returns
    engine.submit(request("running"), out.sink)
    engine.submit(request("queued"), out.sink)
    assert decoder.started.wait(5)
    engine.fail("rank 1 (host h, pid 7) sent no heartbeat for 5 s")
    for rid in ("running", "queued"):
        assert out.final(rid, timeout=1).error.startswith("rank 1 (host h, pid 7)")
    assert engine.stats().waiting == 0 and engine.state is EngineState.FAILED
    decoder.release.set()  # when it comes back nothing more reaches the sinks
    time.sleep(0.1)
    assert all(events[-1].final and sum(e.final for e in events) == 1 for events in out.by_id.values())


def test_drain_lets_running_and_queued_requests_finish_and_refuses_new_ones(setup):
    engine, decoder, _, out = setup(round_s=0.01)
    engine.submit(request("a", max_new=20), out.sink)
    engine.submit(request("b", max_new=20), out.sink)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("ok", engine.drain(10)))
    thread.start()
    time.sleep(0.05)
    assert engine.state is EngineState.DRAINING
    with pytest.raises(EngineUnavailable, match="draining"):
        engine.submit(request("c"), out.sink)
    thread.join(10)
    assert result["ok"] is True
    assert out.final("a").finish_reason == out.final("b").finish_reason == "length"
    engine.shutdown()
    assert engine.state is EngineState.STOPPED


def test_drain_past_its_timeout_aborts_what_is_left(setup):
    engine, decoder, target, out = setup(round_s=0.02)
    engine.submit(request("long", max_new=10_000), out.sink)
    engine.submit(request("queued"), out.sink)
    assert engine.drain(0.2) is False
    assert out.final("queued", timeout=1).error == "the server is shutting down"
    assert out.final("long", timeout=2).finish_reason == "abort"
    engine.shutdown()
    assert target.length == 0


# -- the real decoders --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target():
    from tiny_models import tiny_checkpoint

    return tiny_checkpoint("qwen3", "bf16")


def test_target_alone_through_the_engine_equals_generate(tiny_target):
    from tiny_models import tiny_tokenizer

    from hetero_run.launch.generate import GenerateConfig, TargetOnly, run_prompts
    from hetero_run.launch.generate import Prompt as CliPrompt
    from hetero_run.runtime.models.loader import load_model
    from hetero_run.runtime.runner import TargetRunner

    tokenizer = tiny_tokenizer()
    model = load_model(tiny_target, dtype=torch.float32, max_tokens=96)
    prompts = ["def add(a, b):", "The cat sat on"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    with TargetRunner(model) as runner:
        expected = {}
        for params in (SamplingParams(), sampled):
            config = GenerateConfig(target=Path(tiny_target), sampling=params, max_new_tokens=20)
            results = []
            run_prompts(TargetOnly(runner, params), tokenizer, [CliPrompt(p, "t") for p in prompts], config, set(),
                        model.max_tokens, None, results.append)
            expected[params] = [(r.token_ids, r.text) for r in results]
        meter = RoundMeter(runner)
        engine = SerialEngine(max_queue=8)
        decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
        engine.start(TargetOnly(meter, SamplingParams()), meter, decode, max_context=model.max_tokens)
        out, submitted = Collector(), []
        for params in (SamplingParams(), sampled, sampled):
            for i, p in enumerate(prompts):
                ids = tuple(tokenizer(p)["input_ids"])
                engine.submit(GenerationRequest(f"{len(submitted)}-{submitted.append(i)}",
                                                Prompt(text=p, target_ids=ids), 20, params), out.sink)
        engine.drain(60)
        engine.shutdown()
        got = [([t for e in events for t in e.token_ids], "".join(e.text for e in events))
               for events in out.by_id.values()]
        assert got == expected[SamplingParams()] + expected[sampled] * 2  # greedy, and a seeded sample twice
        for events in out.by_id.values():
            spec = events[-1].speculation
            assert (spec.rounds, spec.drafts, spec.accepted_tokens) == (20, 0, 0)
        assert model.length == 0
