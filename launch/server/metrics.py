"""Prometheus metrics at GET /metrics, named like vLLM's under `hetero_run:`.

| metric | kind | what |
|---|---|---|
| hetero_run:num_requests_running / _waiting | gauge | the engine's running and queued requests |
| hetero_run:kv_cache_usage_perc | gauge | share of the target's KV cache in use (0..1) |
| hetero_run:engine_state{state} | gauge | 1 for the current state (loading, ready, draining, stopped, failed) |
| hetero_run:prompt_tokens_total / generation_tokens_total | counter | tokens of finished requests |
| hetero_run:request_success_total{finished_reason} | counter | requests by finish reason (stop, length, abort, error) |
| hetero_run:request_rejected_total{reason} | counter | refused before running (queue_full, unavailable, invalid) |
| hetero_run:time_to_first_token_seconds | histogram | arrival to the first generated token |
| hetero_run:time_per_output_token_seconds | histogram | per request: (last token - first token) / (tokens - 1) |
| hetero_run:e2e_request_latency_seconds | histogram | arrival to the final event |
| hetero_run:spec_decode_num_drafts_total | counter | verify rounds that carried draft tokens |
| hetero_run:spec_decode_num_draft_tokens_total / _accepted_tokens_total | counter | draft tokens verified / accepted |
| hetero_run:spec_decode_num_accepted_tokens_per_pos_total{position} | counter | accepted at depth position + 1 |

Observations happen where the engine hands events over (its own thread; prometheus-client is
thread-safe), so a client that stops reading does not stop the figures.
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily

from hetero_run.runtime.engine.api import EngineState, GenerationEvent

PREFIX = "hetero_run:"
disable_created_metrics()  # no *_created series: one line per figure
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineGauges:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, doc, value in (("num_requests_running", "Requests being generated.", stats.running),
                                 ("num_requests_waiting", "Requests waiting in the queue.", stats.waiting),
                                 ("kv_cache_usage_perc", "Share of the KV cache in use (0..1).", stats.kv_usage)):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        state = GaugeMetricFamily(PREFIX + "engine_state", "1 for the engine's current state.", labels=["state"])
        for s in EngineState:
            state.add_metric([s.value], 1.0 if self.engine.state is s else 0.0)
        yield state


class Metrics:
    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        registry.register(_EngineGauges(engine))

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, labels, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.rejected = counter("request_rejected", "Requests refused before they ran.", ["reason"])
        self.drafts = counter("spec_decode_num_drafts", "Verify rounds that carried draft tokens.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_position = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their depth in the draft (0: the first).",
                                             ["position"])
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to the first generated token.",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Per request: time per token after the first.",
                              buckets=TOKEN_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to the final event.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        # for the live line: plain totals and recent token times
        self._lock = threading.Lock()
        self.finished = self.failed = 0
        self.accepted = self.drafted = 0
        self._recent: list[tuple[float, int]] = []

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float) -> RequestTimer:
        return RequestTimer(self, arrival)

    def recent_tokens_per_second(self, window_s: float = 5.0) -> float:
        now = time.monotonic()
        with self._lock:
            self._recent = [(t, n) for t, n in self._recent if now - t <= window_s]
            return sum(n for _, n in self._recent) / window_s

    def _tokens(self, n: int) -> None:
        with self._lock:
            self._recent.append((time.monotonic(), n))


class RequestTimer:
    """One request's timings, fed with its events as the engine hands them over."""

    def __init__(self, metrics: Metrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.first: float | None = None

    def observe(self, event: GenerationEvent) -> None:
        m, now = self.metrics, time.monotonic()
        if event.token_ids:
            m._tokens(len(event.token_ids))
            if self.first is None:
                self.first = now
                m.ttft.observe(now - self.arrival)
        if not event.final:
            return
        m.e2e.observe(now - self.arrival)
        m.success.labels(event.finish_reason).inc()
        with m._lock:
            m.finished += 1
            m.failed += event.finish_reason == "error"
        if event.usage is not None:
            m.prompt_tokens.inc(event.usage.prompt_tokens)
            m.generation_tokens.inc(event.usage.completion_tokens)
            if self.first is not None and event.usage.completion_tokens > 1:
                m.tpot.observe((now - self.first) / (event.usage.completion_tokens - 1))
        spec = event.speculation
        if spec is not None:
            m.drafts.inc(spec.drafts)
            m.draft_tokens.inc(spec.draft_tokens)
            m.accepted_tokens.inc(spec.accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                m.accepted_per_position.labels(str(position)).inc(count)
            with m._lock:
                m.drafted += spec.draft_tokens
                m.accepted += spec.accepted_tokens
