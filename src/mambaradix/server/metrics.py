"""Prometheus metrics of one server app, in a registry of its own (two apps never share series).

Two sources:

- the server records what it serves: prompt / cached / generated token counters, request
  counts by finish reason, and TTFT, inter-token and end-to-end latency histograms
  (``RequestTimer`` is fed every ``RequestOutput`` of a request);
- ``EngineStatsCollector`` reads ``engine.stats()`` at scrape time: running / waiting requests,
  token and mamba usage, evictions, retractions, skipped snapshots, state copies.

Names use the ``mambaradix:`` prefix (as SGLang uses ``sglang:``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "mambaradix:"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip

# EngineStats field -> (metric suffix, kind, help); read at scrape time.
_ENGINE_GAUGES = {
    "num_running": ("num_running_reqs", "Requests running in the engine."),
    "num_waiting": ("num_queue_reqs", "Requests waiting to be admitted."),
    "token_usage": ("token_usage", "KV pool usage: (size - free - evictable) / size."),
    "mamba_usage": ("mamba_usage", "State pool usage: (size - free - evictable) / size."),
}
_ENGINE_COUNTERS = {
    "computed_prefill_tokens": ("computed_prefill_tokens", "Prompt tokens actually computed."),
    "evicted_kv_tokens": ("evicted_kv_tokens", "KV tokens evicted from the radix tree."),
    "evicted_states": ("evicted_states", "State snapshots evicted from the radix tree."),
    "retractions": ("retractions", "Running requests retracted for lack of KV memory."),
    "skipped_snapshots": ("skipped_snapshots", "Snapshots skipped for lack of a state slot."),
    "state_copies": ("state_copies", "Recurrent-state slot copies executed."),
    "state_copy_bytes": ("state_copy_bytes", "Bytes moved by recurrent-state slot copies."),
    "finished_requests": ("engine_finished_requests", "Requests finished by the engine."),
}


class EngineStatsCollector(Collector):
    """Turns ``engine.stats()`` into gauges and counters on every scrape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # a scrape must not fail because the engine is shutting down
            logger.exception("engine.stats() failed during a metrics scrape")
            return
        for field_name, (suffix, help_text) in _ENGINE_GAUGES.items():
            if hasattr(stats, field_name):
                g = GaugeMetricFamily(PREFIX + suffix, help_text)
                g.add_metric([], float(getattr(stats, field_name)))
                yield g
        for field_name, (suffix, help_text) in _ENGINE_COUNTERS.items():
            if hasattr(stats, field_name):
                c = CounterMetricFamily(PREFIX + suffix, help_text)
                c.add_metric([], float(getattr(stats, field_name)))
                yield c


class ServerMetrics:
    """All metrics of one app. ``render()`` gives the text exposition format."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of served requests.", labels, registry=r
        )
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens",
            "Prompt tokens served from the prefix cache.",
            labels,
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of served requests.", labels, registry=r
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Finished requests by finish reason (stop, length, abort, error).",
            labels + ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.registry.register(EngineStatsCollector(engine))
        self.model_name = model_name

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def count_error(self) -> None:
        self.requests.labels(self.model_name, "error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping: ``observe(out)`` for every engine event, in order."""

    __slots__ = ("metrics", "arrival", "last", "done", "counted_prompt")

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last: float | None = None
        self.done = False
        self.counted_prompt = False

    def observe(self, out: Any) -> None:
        m, name = self.metrics, self.metrics.model_name
        now = time.perf_counter()
        if not self.counted_prompt:
            self.counted_prompt = True
            m.prompt_tokens.labels(name).inc(out.prompt_tokens)
            m.cached_tokens.labels(name).inc(max(0, out.cached_tokens))
        n = len(out.new_token_ids)
        if n:
            m.generation_tokens.labels(name).inc(n)
            if self.last is None:
                m.ttft.labels(name).observe(now - self.arrival)
                # tokens delivered together with the first share its arrival: no ITL sample
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    m.itl.labels(name).observe(gap)
            self.last = now
        if out.finished and not self.done:
            self.done = True
            m.e2e.labels(name).observe(now - self.arrival)
            m.requests.labels(name, out.finish_reason or "abort").inc()
