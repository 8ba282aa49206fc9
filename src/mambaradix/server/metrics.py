"""Prometheus metrics of one server app, in a registry of its own (two apps never share series).

Names and labels are SGLang's (``sglang:num_running_reqs``, ``sglang:prompt_tokens_total``,
``sglang:time_to_first_token_seconds`` ...) behind our prefix (``--metrics-prefix``, default
``mambaradix``; ``sglang`` lets SGLang's dashboards work unchanged), and every series carries
``model_name``. Two sources:

- the server records what it serves: prompt / cached / generated tokens, finished and aborted
  requests (streams whose client went away included), requests by finish reason, client errors
  (4xx) apart from server errors, and TTFT, inter-token, end-to-end and queue-time histograms
  (``RequestTimer`` is fed every ``RequestOutput`` of a request);
- ``EngineStatsCollector`` reads ``engine.stats()`` at scrape time: running / waiting requests,
  used and total KV tokens, token and mamba usage, generation throughput and cache hit rate
  since the previous scrape, and our own counters (evictions, skipped snapshots, state copies).
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

DEFAULT_PREFIX = "mambaradix"

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_QUEUE_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 300, 1000)

# EngineStats field -> (metric name, help); read at scrape time.
_ENGINE_GAUGES = {
    "num_running": ("num_running_reqs", "The number of running requests."),
    "num_waiting": ("num_queue_reqs", "The number of requests in the waiting queue."),
    "num_used_tokens": ("num_used_tokens", "KV tokens in use: size - free - evictable."),
    "max_total_num_tokens": ("max_total_num_tokens", "Size of the KV pool in tokens."),
    "token_usage": ("token_usage", "KV pool usage: (size - free - evictable) / size."),
    "mamba_usage": ("mamba_usage", "State pool usage: (size - free - evictable) / size."),
    "decode_graph_bytes": ("decode_graph_bytes", "Bytes held by the recorded decode steps."),
    "storage_objects": ("storage_objects", "Objects held by the storage tier's backend."),
    "storage_bytes": ("storage_bytes", "Bytes held by the storage tier's backend."),
}
_ENGINE_COUNTERS = {
    "retractions": ("num_retracted_requests", "Running requests retracted for lack of KV."),
    "computed_prefill_tokens": ("computed_prefill_tokens", "Prompt tokens actually computed."),
    "evicted_kv_tokens": ("evicted_kv_tokens", "KV tokens evicted from the radix tree."),
    "evicted_states": ("evicted_states", "State snapshots evicted from the radix tree."),
    "skipped_snapshots": ("skipped_snapshots", "Snapshots skipped for lack of a state slot."),
    "state_copies": ("state_copies", "Recurrent-state slot copies executed."),
    "state_copy_bytes": ("state_copy_bytes", "Bytes moved by recurrent-state slot copies."),
    "finished_requests": ("engine_finished_requests", "Requests finished by the engine."),
    "decode_graph_replays": ("decode_graph_replays", "Decode steps replayed from a recording."),
    "spec_verify_ct": ("spec_verify_ct", "Speculative verify steps (one per request per step)."),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Tokens emitted by speculative verify steps."),
    "spec_draft_tokens": ("spec_draft_tokens", "Draft tokens scored by speculative verify steps."),
    "decode_graph_recordings": ("decode_graph_recordings", "Decode steps recorded for replay."),
    "lost_reuse_requests": (
        "lost_reuse_requests",
        "Requests whose KV matched deeper than any state they could resume from.",
    ),
    "lost_reuse_tokens": (
        "lost_reuse_tokens",
        "Matched tokens recomputed because no state snapshot was kept where the match ended.",
    ),
    "storage_hit_tokens": ("storage_hit_tokens", "Cached prompt tokens read from storage."),
    "storage_loads": ("storage_loads", "Prefixes loaded back from the storage tier."),
    "storage_load_failures": (
        "storage_load_failures",
        "Loads that found a missing or bad object (the request recomputed).",
    ),
    "storage_bad_objects": ("storage_bad_objects", "Corrupt or foreign stored objects removed."),
    "storage_load_seconds": ("storage_load_seconds", "Seconds spent loading, summed over loads."),
    "storage_bytes_read": ("storage_bytes_read", "Bytes read from the storage tier."),
    "storage_bytes_written": ("storage_bytes_written", "Bytes written to the storage tier."),
    "storage_objects_written": ("storage_objects_written", "Objects written to storage."),
    "storage_write_failures": ("storage_write_failures", "Objects the backend failed to store."),
    "storage_writes_skipped": (
        "storage_writes_skipped",
        "Writes skipped (too many bytes waiting to be written).",
    ),
}


class EngineStatsCollector(Collector):
    """Turns ``engine.stats()`` into gauges and counters on every scrape; the two rates
    (``gen_throughput``, ``cache_hit_rate``) cover the time since the previous scrape."""

    def __init__(self, engine: Any, prefix: str, model_name: str) -> None:
        self.engine = engine
        self.prefix = prefix + ":"
        self.model_name = model_name
        self._last = (time.monotonic(), 0, 0, 0)  # (time, generated, prompt, cached)
        self._hit_rate = 0.0

    def _family(self, kind: type, name: str, help_text: str, value: float) -> Metric:
        m = kind(self.prefix + name, help_text, labels=["model_name"])
        m.add_metric([self.model_name], float(value))
        return m

    def _rates(self, stats: Any) -> tuple[float, float]:
        now = time.monotonic()
        t0, gen0, prompt0, cached0 = self._last
        gen, prompt, cached = stats.generated_tokens, stats.prompt_tokens, stats.cached_tokens
        self._last = (now, gen, prompt, cached)
        throughput = (gen - gen0) / (now - t0) if now > t0 else 0.0
        if prompt > prompt0:  # no new prompt since the last scrape: keep the last rate
            self._hit_rate = (cached - cached0) / (prompt - prompt0)
        return throughput, self._hit_rate

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # a scrape must not fail because the engine is shutting down
            logger.exception("engine.stats() failed during a metrics scrape")
            return
        for field_name, (name, help_text) in _ENGINE_GAUGES.items():
            if hasattr(stats, field_name):
                yield self._family(GaugeMetricFamily, name, help_text, getattr(stats, field_name))
        throughput, hit_rate = self._rates(stats)
        yield self._family(
            GaugeMetricFamily, "gen_throughput", "Generation throughput (token/s).", throughput
        )
        yield self._family(
            GaugeMetricFamily,
            "cache_hit_rate",
            "Prefix cache hit rate: cached / prompt tokens of the requests admitted since the "
            "previous scrape.",
            hit_rate,
        )
        for field_name, (name, help_text) in _ENGINE_COUNTERS.items():
            if hasattr(stats, field_name):
                yield self._family(CounterMetricFamily, name, help_text, getattr(stats, field_name))
        if stats.spec_verify_ct:
            yield self._family(
                GaugeMetricFamily,
                "spec_accept_length",
                "Mean tokens a speculative verify step emitted (accepted drafts + 1), since start.",
                stats.spec_accepted_tokens / stats.spec_verify_ct,
            )


class ServerMetrics:
    """All metrics of one app. ``render()`` gives the text exposition format."""

    def __init__(self, engine: Any, model_name: str, prefix: str = DEFAULT_PREFIX) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        p = prefix + ":"
        labels = ["model_name"]

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(p + name, help_text, labels + list(extra), registry=r)

        def histogram(name: str, help_text: str, buckets: tuple) -> Histogram:
            return Histogram(p + name, help_text, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the cache.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_requests = counter("num_requests", "Requests finished (any finish reason).")
        self.num_aborted = counter(
            "num_aborted_requests", "Requests aborted (client gone, shutdown), streams included."
        )
        self.requests = counter(
            "requests",
            "Requests that reached the engine, by finish reason (stop, length, abort, error: a "
            "fault while serving it).",
            ("finish_reason",),
        )
        self.client_errors = counter(
            "num_client_errors", "Requests refused with a 4xx (bad input, unknown model ...)."
        )
        self.server_errors = counter(
            "num_server_errors", "Requests answered with a 5xx (a fault on the server side)."
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Inter-token latency in seconds.", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            _LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_time = histogram(
            "queue_time_seconds", "Time from arrival to first admission in seconds.",
            _QUEUE_BUCKETS,
        )  # fmt: skip
        self.registry.register(EngineStatsCollector(engine, prefix, model_name))

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def count_error(self, status: int = 400) -> None:
        """One request refused with HTTP ``status`` before or instead of an engine result."""
        (self.client_errors if status < 500 else self.server_errors).labels(self.model_name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping: ``observe(out)`` for every engine event, in order;
    ``aborted()`` when the client went away before the final event."""

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
            if out.queue_time is not None:
                m.queue_time.labels(name).observe(out.queue_time)
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
        if out.finished:
            self._end(out.finish_reason or "abort", now)

    def aborted(self) -> None:
        """The client went away (a stream closed, a request given up): counted as aborted."""
        self._end("abort", time.perf_counter())

    def _end(self, reason: str, now: float) -> None:
        if self.done:
            return
        self.done = True
        m, name = self.metrics, self.metrics.model_name
        m.e2e.labels(name).observe(now - self.arrival)
        m.requests.labels(name, reason).inc()
        m.num_requests.labels(name).inc()
        if reason == "abort":
            m.num_aborted.labels(name).inc()
