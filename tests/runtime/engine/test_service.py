"""runtime/engine/service.py, the batching engine on its own thread: requests join the running batch,
the bounded queue, cancellation within one step, stop strings, failures, drain; over a tiny real
target behind a runner the tests can hold, slow down or break."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_checkpoint, tiny_tokenizer

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.engine.api import EngineState, EngineUnavailable, GenerationRequest, QueueFull
from hetero_run.runtime.engine.engine import EngineConfig, LLMEngine
from hetero_run.runtime.engine.service import BatchEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.prompt import Prompt


class ControlledRunner:
    """The real runner, with a gate (a collective that does not return), a delay per step and an
    injected failure."""

    def __init__(self, runner):
        self.runner = runner
        self.model, self.num_blocks, self.block_size = runner.model, runner.num_blocks, runner.block_size
        self.max_tokens = runner.max_tokens
        self.gate, self.started = threading.Event(), threading.Event()
        self.gate.set()
        self.delay, self.steps, self.fail_at, self.error = 0.0, 0, None, None

    def step(self, batch):
        self.started.set()
        assert self.gate.wait(20)
        time.sleep(self.delay)
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise self.error
        return self.runner.step(batch)


@pytest.fixture(scope="module")
def path():
    return tiny_checkpoint("qwen3", "bf16")


class Collector:
    def __init__(self):
        self.events = queue.Queue()
        self.by_id: dict[str, list] = {}

    def sink(self, event):
        self.by_id.setdefault(event.request_id, []).append(event)
        self.events.put(event)

    def final(self, rid, timeout=20.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            events = self.by_id.get(rid, [])
            if events and events[-1].final:
                return events[-1]
            time.sleep(0.005)
        raise AssertionError(f"{rid} did not finish: {self.by_id.get(rid)}")

    def tokens(self, rid):
        return [t for e in self.by_id[rid] for t in e.token_ids]


@pytest.fixture
def setup(path):
    made = []

    def make(max_queue=8, max_num_seqs=4):
        model = load_model(path, dtype=torch.float32, max_tokens=128, kv_tokens=1024)
        runner = ControlledRunner(TargetRunner(model))
        engine = BatchEngine(max_queue=max_queue)
        engine.start(LLMEngine(runner, tiny_tokenizer(), EngineConfig(max_num_seqs=max_num_seqs)))
        made.append((engine, runner))
        return engine, runner, Collector()

    yield make
    for engine, runner in made:
        runner.gate.set()
        engine.shutdown(timeout=10)


def request(rid, max_new=10, stops=(), stop_ids=frozenset(), prompt_len=6, sampling=None):
    ids = tuple(range(7, 7 + prompt_len))
    return GenerationRequest(rid, Prompt(target_ids=ids), max_new, sampling or SamplingParams(),
                             frozenset(stop_ids), tuple(stops))


def test_requests_run_together_each_ending_with_one_final_event(setup):
    engine, runner, out = setup()
    runner.gate.clear()
    for i in range(4):
        engine.submit(request(f"r{i}", max_new=6), out.sink)
    runner.gate.set()
    finals = [out.final(f"r{i}") for i in range(4)]
    order = []
    while not out.events.empty():
        order.append(out.events.get().request_id)
    assert len({tuple(order[i:i + 4]) for i in range(0, 8, 4)}) >= 1 and order[:4] != ["r0"] * 4  # interleaved
    for i, final in enumerate(finals):
        events = out.by_id[f"r{i}"]
        assert [e.final for e in events] == [False] * (len(events) - 1) + [True]
        assert final.finish_reason == "length" and final.usage.completion_tokens == 6 == len(out.tokens(f"r{i}"))
        assert final.usage.prompt_tokens == 6
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_a_steps_events_reach_the_sinks_when_the_step_ends(setup):
    """Events wait for the end of the step that made them, so the server's sinks wake its event
    loop once for all of them; each request's still come in order, the final one last."""
    engine, runner, out = setup()
    inner, stepping, during = engine.engine.step, threading.Event(), []

    def step():
        stepping.set()
        try:
            inner()
        finally:
            stepping.clear()

    def sink(event):
        during.append(stepping.is_set())
        out.sink(event)

    engine.engine.step = step
    runner.gate.clear()
    for i in range(3):
        engine.submit(request(f"r{i}", max_new=4), sink)
    runner.gate.set()
    for i in range(3):
        assert out.final(f"r{i}").finish_reason == "length" and len(out.tokens(f"r{i}")) == 4
        assert [e.final for e in out.by_id[f"r{i}"]][-1] is True
    assert len(during) >= 12 and not any(during)


def test_the_queue_is_bounded(setup):
    engine, runner, out = setup(max_queue=2, max_num_seqs=1)
    runner.gate.clear()
    engine.submit(request("running"), out.sink)
    assert runner.started.wait(10)
    engine.submit(request("w1"), out.sink)
    engine.submit(request("w2"), out.sink)
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        engine.submit(request("w3"), out.sink)
    assert engine.stats().running == 1 and engine.stats().waiting == 2
    runner.gate.set()
    for rid in ("running", "w1", "w2"):
        assert out.final(rid).finish_reason == "length"
    assert "w3" not in out.by_id


def test_cancel_stops_a_running_request_within_one_step_and_frees_its_blocks(setup):
    engine, runner, out = setup()
    runner.delay = 0.01
    engine.submit(request("r", max_new=100), out.sink)
    while runner.steps < 4:
        time.sleep(0.005)
    engine.cancel("r")
    at_cancel = runner.steps
    assert out.final("r").finish_reason == "abort"
    assert runner.steps <= at_cancel + 1
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == 0
    engine.submit(request("next", max_new=3), out.sink)  # and the engine goes on
    assert out.final("next").finish_reason == "length"


def test_cancel_of_a_queued_request_ends_it_at_once(setup):
    engine, runner, out = setup(max_num_seqs=1)
    runner.gate.clear()
    engine.submit(request("running"), out.sink)
    assert runner.started.wait(10)
    engine.submit(request("queued"), out.sink)
    engine.cancel("queued")
    assert out.final("queued", timeout=2).finish_reason == "abort"
    runner.gate.set()
    assert out.final("running").finish_reason == "length"
    assert len(out.by_id["queued"]) == 1


def test_a_stop_string_ends_generation_at_once(setup, path):
    engine, runner, out = setup()
    engine.submit(request("plain", max_new=20), out.sink)
    out.final("plain")
    text = "".join(e.text for e in out.by_id["plain"])
    stop = text[3:5]
    before = runner.steps
    engine.submit(request("cut", max_new=20, stops=(stop,)), out.sink)
    final = out.final("cut")
    got = "".join(e.text for e in out.by_id["cut"])
    assert final.finish_reason == "stop" and got == text[:text.index(stop)]
    assert runner.steps - before < 20


def test_an_end_of_sequence_token_finishes_with_stop(setup):
    engine, _, out = setup()
    engine.submit(request("plain", max_new=12), out.sink)
    out.final("plain")
    eos = out.tokens("plain")[4]
    engine.submit(request("r", max_new=12, stop_ids={eos}), out.sink)
    final = out.final("r")
    assert final.finish_reason == "stop"
    assert out.tokens("r") == out.tokens("plain")[:out.tokens("plain").index(eos) + 1]


def test_a_request_that_can_never_run_ends_alone(setup):
    engine, _, out = setup()
    engine.submit(request("huge", max_new=500), out.sink)
    engine.submit(request("good", max_new=2), out.sink)
    bad = out.final("huge")
    assert bad.finish_reason == "error" and "exceed the context of 128 tokens" in bad.error
    assert out.final("good").finish_reason == "length" and engine.state is EngineState.READY


def test_any_other_error_fails_the_engine_and_every_request(setup):
    engine, runner, out = setup()
    engine.describe_failure = lambda exc: f"rank 1 stopped responding: {exc}"
    runner.fail_at, runner.error = 3, RuntimeError("Connection reset by peer")
    runner.gate.clear()
    engine.submit(request("a", max_new=20), out.sink)
    engine.submit(request("b", max_new=20), out.sink)
    runner.gate.set()
    for rid in ("a", "b"):
        final = out.final(rid)
        assert final.finish_reason == "error" and final.error == "rank 1 stopped responding: Connection reset by peer"
    assert engine.state is EngineState.FAILED and "rank 1" in engine.error
    with pytest.raises(EngineUnavailable, match="rank 1 stopped responding"):
        engine.submit(request("late"), out.sink)


def test_fail_from_another_thread_ends_requests_while_the_engine_is_stuck(setup):
    engine, runner, out = setup(max_num_seqs=1)
    runner.gate.clear()  # the engine's thread is blocked, as in a collective that never returns
    engine.submit(request("running"), out.sink)
    assert runner.started.wait(10)
    engine.submit(request("queued"), out.sink)
    engine.fail("rank 1 (host h, pid 7) sent no heartbeat for 5 s")
    for rid in ("running", "queued"):
        assert out.final(rid, timeout=2).error.startswith("rank 1 (host h, pid 7)")
    assert engine.state is EngineState.FAILED
    runner.gate.set()  # when it comes back nothing more reaches the sinks
    time.sleep(0.2)
    assert all(events[-1].final and sum(e.final for e in events) == 1 for events in out.by_id.values())


def test_drain_lets_running_and_queued_requests_finish_and_refuses_new_ones(setup):
    engine, runner, out = setup(max_num_seqs=1)
    runner.delay = 0.005
    engine.submit(request("a", max_new=20), out.sink)
    engine.submit(request("b", max_new=20), out.sink)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("ok", engine.drain(30)))
    thread.start()
    time.sleep(0.05)
    assert engine.state is EngineState.DRAINING
    with pytest.raises(EngineUnavailable, match="draining"):
        engine.submit(request("c"), out.sink)
    thread.join(30)
    assert result["ok"] is True
    assert out.final("a").finish_reason == out.final("b").finish_reason == "length"
    engine.shutdown()
    assert engine.state is EngineState.STOPPED


def test_drain_past_its_timeout_aborts_what_is_left(setup):
    engine, runner, out = setup(max_num_seqs=1)
    runner.delay = 0.02
    engine.submit(request("long", max_new=100), out.sink)
    engine.submit(request("queued"), out.sink)
    while runner.steps < 1:
        time.sleep(0.005)
    assert engine.drain(0.2) is False
    assert out.final("queued", timeout=2).error == "the server is shutting down"
    assert out.final("long", timeout=5).finish_reason == "abort"
    engine.shutdown()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_the_engine_equals_generate_for_greedy_and_seeded_sampling(path):
    from hetero_run.launch.generate import GenerateConfig, TargetOnly, run_prompts
    from hetero_run.launch.generate import Prompt as CliPrompt

    tokenizer = tiny_tokenizer()
    model = load_model(path, dtype=torch.float32, max_tokens=96)
    prompts = ["def add(a, b):", "The cat sat on"]
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    with TargetRunner(model) as runner:
        expected = {}
        for params in (SamplingParams(), sampled):
            config = GenerateConfig(target=Path(path), sampling=params, max_new_tokens=20)
            results = []
            run_prompts(TargetOnly(runner, params), tokenizer, [CliPrompt(p, "t") for p in prompts], config, set(),
                        model.max_tokens, None, results.append)
            expected[params] = [(r.token_ids, r.text) for r in results]
    model = load_model(path, dtype=torch.float32, max_tokens=96, kv_tokens=1024)
    engine = BatchEngine(max_queue=8)
    engine.start(LLMEngine(TargetRunner(model), tokenizer, EngineConfig(max_num_seqs=6)))
    out, order = Collector(), []
    for params in (SamplingParams(), sampled, sampled):
        for p in prompts:
            rid = str(len(order))
            order.append(rid)
            ids = tuple(tokenizer(p)["input_ids"])
            engine.submit(GenerationRequest(rid, Prompt(text=p, target_ids=ids), 20, params), out.sink)
    assert engine.drain(120)
    engine.shutdown()
    got = [(out.tokens(rid), "".join(e.text for e in out.by_id[rid])) for rid in order]
    assert got == expected[SamplingParams()] + expected[sampled] * 2  # greedy, and a seeded sample twice
    for rid in order:
        spec = out.by_id[rid][-1].speculation
        assert (spec.rounds, spec.drafts, spec.accepted_tokens) == (20, 0, 0)
