"""500 requests through the batching engine on its thread (runtime/engine/service.py), with a
drafter: random prompt lengths over shared prefixes, random max_tokens, stop strings, greedy and
seeded sampling, cancellations while queued and mid-stream, submissions past the queue bound,
requests that can never run, and a KV cache small enough that preemption happens. Afterwards
every KV block and drafter slot is free again, nothing is left in the scheduler or the service,
and every accepted request got exactly one final event (a refused one none)."""

from __future__ import annotations

import functools
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import speculative_support as support
import torch
from support import one_thread  # noqa: F401  (autouse: tiny tensor ops run best on one thread)

from hetero_run.kernels.sampling import SamplingParams
from hetero_run.runtime.drafters.hf import HFDraftModel
from hetero_run.runtime.drafters.load import Drafter
from hetero_run.runtime.engine.api import GenerationRequest, QueueFull
from hetero_run.runtime.engine.engine import EngineConfig, LLMEngine
from hetero_run.runtime.engine.service import BatchEngine
from hetero_run.runtime.models.loader import load_model
from hetero_run.runtime.runner import TargetRunner
from hetero_run.runtime.speculative.config import SpeculationConfig
from hetero_run.runtime.speculative.prompt import Prompt

REQUESTS = 500
CONTEXT = 160
KV_TOKENS = 192  # 24 blocks of 8: a few requests at a time, fewer than max_num_seqs when they grow
BLOCK = 8
MAX_QUEUE = 6
MAX_NUM_SEQS = 6
STOP_STRINGS = ("\n", " the", "(", ":", "o")
DEADLINE_S = 150.0  # about 30 s here; a leak of blocks stalls the engine instead


@functools.cache
def _models():
    target = support.trained_model(support.byte_level(), "qwen2", seed=0)
    drafter = support.trained_model(support.sentencepiece(), "llama", seed=1)
    return target, drafter


@dataclass
class Plan:
    """One request to send, and what the test does with it."""

    request: GenerationRequest
    cancel: str | None = None  # "queued": right after submit; "streaming": after its first delta
    impossible: bool = False


def _plans(seed: int = 0) -> list[Plan]:
    """REQUESTS requests over a pool of prompts (so some repeat whole), most of them starting with
    one of a few shared prefixes."""
    rng = random.Random(seed)
    tokenizer = support.byte_level()
    texts = support.CORPUS[:len(support.CORPUS) // 4]
    prefixes = [t[:rng.randrange(20, len(t))] for t in texts[:4]]  # shared "system prompts"
    pool = []
    for _ in range(120):
        body = rng.choice(texts)
        cut = rng.randrange(0, len(body))
        pool.append((rng.choice(prefixes) if rng.random() < 0.6 else "") + body[cut:cut + rng.randrange(1, 60)])
    out = []
    for i in range(REQUESTS):
        text = rng.choice(pool)
        ids = tuple(tokenizer(text)["input_ids"])
        sampling = SamplingParams() if rng.random() < 0.7 else SamplingParams(temperature=0.9, top_p=0.9,
                                                                              seed=rng.randrange(1000))
        stops = (rng.choice(STOP_STRINGS),) if rng.random() < 0.25 else ()
        new = rng.randrange(1, 33)
        impossible = rng.random() < 0.01
        roll = rng.random()
        cancel = None if impossible else "queued" if roll < 0.04 else "streaming" if roll < 0.14 else None
        request = GenerationRequest(f"r{i}", Prompt(text=text, target_ids=ids), CONTEXT + 1 if impossible else new,
                                    sampling, frozenset({tokenizer.eos_token_id}), stops)
        out.append(Plan(request, cancel, impossible))
    return out


@dataclass
class Record:
    events: list = field(default_factory=list)
    finals: int = 0


class Client:
    """Every request's events; asks for mid-stream cancellations off the engine's thread."""

    def __init__(self, plans: list[Plan]):
        self.plans = {p.request.request_id: p for p in plans}
        self.records: dict[str, Record] = {}
        self.lock = threading.Lock()
        self.finished = threading.Semaphore(0)
        self.to_cancel: queue.Queue[str | None] = queue.Queue()

    def sink(self, event):
        with self.lock:
            record = self.records.setdefault(event.request_id, Record())
            record.events.append(event)
            first_delta = not event.final and len(record.events) == 1
            if event.final:
                record.finals += 1
        if first_delta and self.plans[event.request_id].cancel == "streaming":
            self.to_cancel.put(event.request_id)
        if event.final:
            self.finished.release()

    def cancel_loop(self, engine: BatchEngine) -> None:
        while (rid := self.to_cancel.get()) is not None:
            engine.cancel(rid)


def _tokens(record: Record) -> list[int]:
    return [t for e in record.events for t in e.token_ids]


def test_500_requests_leave_every_block_and_drafter_slot_free():
    target, drafter = _models()
    runner = TargetRunner(load_model(target, max_tokens=CONTEXT, kv_tokens=KV_TOKENS, dtype=torch.float32,
                                     block_size=BLOCK))
    llm = LLMEngine(runner, support.byte_level(),
                    EngineConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=40, enable_prefix_caching=True),
                    Drafter(HFDraftModel(drafter), support.sentencepiece(), "sentencepiece"),
                    SpeculationConfig(algorithm="auto"))
    slots = llm.speculation.free_slots
    assert slots >= 1
    engine = BatchEngine(max_queue=MAX_QUEUE)
    engine.start(llm)
    plans = _plans()
    client = Client(plans)
    canceller = threading.Thread(target=client.cancel_loop, args=(engine,), daemon=True)
    canceller.start()
    refused: Counter[str] = Counter()
    deadline = time.monotonic() + DEADLINE_S
    try:
        for plan in plans:
            while True:  # a refused request is sent again once another has finished, as a client retries a 429
                assert time.monotonic() < deadline, "the engine stopped making progress"
                try:
                    engine.submit(plan.request, client.sink)
                    break
                except QueueFull:
                    refused[plan.request.request_id] += 1
                    client.finished.acquire(timeout=1.0)
            if plan.cancel == "queued":
                engine.cancel(plan.request.request_id)
        while True:
            with client.lock:
                done = sum(r.finals for r in client.records.values())
            if done >= REQUESTS:
                break
            assert time.monotonic() < deadline, f"only {done} of {REQUESTS} requests finished"
            client.finished.acquire(timeout=1.0)
        time.sleep(0.05)  # anything sent after a final event would arrive now
        blocks, scheduler, spec = llm.blocks, llm.scheduler, llm.speculation

        # nothing is held
        assert blocks.num_free == blocks.num_blocks and all(r == 0 for r in blocks.refs)
        assert sorted([*blocks.free, *blocks.cached]) == list(range(blocks.num_blocks))  # each block once
        assert set(blocks.cached) == set(blocks.key_of) and sorted(blocks.by_key.values()) == sorted(blocks.key_of)
        assert spec.free_slots == slots and not spec.views
        assert not scheduler.running and not scheduler.waiting and not llm.by_id and not llm.has_work()
        assert not engine._live and not engine._inbox and not engine._cancels
        stats = engine.stats()
        assert (stats.running, stats.waiting, stats.kv_blocks_free) == (0, 0, stats.kv_blocks_total)

        # the load did what it is for
        assert scheduler.preemptions > 0, "the KV cache never ran short"
        assert sum(refused.values()) > 0, "the queue bound was never reached"
        reasons = Counter()
        cached = 0
        greedy: dict[tuple, list[list[int]]] = {}
        for plan in plans:
            rid, request = plan.request.request_id, plan.request
            record = client.records.get(rid)
            assert record is not None and record.finals == 1 and record.events[-1].final, rid
            final = record.events[-1]
            tokens = _tokens(record)
            reasons[final.finish_reason] += 1
            if plan.impossible:
                assert final.finish_reason == "error" and "exceed the context" in final.error, rid
                continue
            # a cancellation may land after the request has finished
            assert final.finish_reason in (("stop", "length", "abort") if plan.cancel else ("stop", "length")), rid
            if final.finish_reason != "abort":
                assert final.usage.completion_tokens == len(tokens) <= request.max_new_tokens, rid
                assert final.usage.prompt_tokens == request.prompt_tokens, rid
            if final.finish_reason == "length":
                assert len(tokens) == request.max_new_tokens, rid
            if final.finish_reason == "stop" and not request.stop_strings:
                assert tokens[-1] in request.stop_ids, rid
            text = "".join(e.text for e in record.events)
            assert not any(stop in text for stop in request.stop_strings), rid
            assert 0 <= final.usage.cached_tokens < max(1, request.prompt_tokens)
            cached += final.usage.cached_tokens
            if request.sampling.greedy:
                greedy.setdefault(request.prompt.target_ids, []).append(tokens)
        assert reasons["abort"] > 0 and reasons["stop"] > 0 and reasons["length"] > 0, reasons
        assert cached > 0, "no prompt came from the prefix cache"
        # greedy requests for one prompt, batched, preempted, cancelled or cut differently, agree
        # token for token: each output is the start of the longest
        repeated = 0
        for outputs in greedy.values():
            longest = max(outputs, key=len)
            for tokens in outputs:
                assert tokens == longest[:len(tokens)]
            repeated += len(outputs) > 1
        assert repeated > 0
    finally:
        client.to_cancel.put(None)
        engine.shutdown(timeout=30)
    assert engine._thread is not None and not engine._thread.is_alive()
