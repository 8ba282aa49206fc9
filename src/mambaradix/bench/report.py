"""Benchmark figures from request results, and their fixed-format printouts.

``summarize`` gives one flat dict (also what ``--output-json`` stores); ``format_summary``
prints it like SGLang's bench_serving; ``format_comparison`` prints cache on vs off with ratios.
Hit rate = sum(cached_tokens) / sum(prompt tokens); the ideal hit rate comes from
``workloads.ideal_hits`` over the same requests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mambaradix.bench.client import RequestResult
from mambaradix.bench.workloads import ideal_hits


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    """mean / median / p99 in milliseconds (0 when there is no sample)."""
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    if arr.size == 0:
        return {f"mean_{prefix}_ms": 0.0, f"median_{prefix}_ms": 0.0, f"p99_{prefix}_ms": 0.0}
    return {
        f"mean_{prefix}_ms": float(arr.mean()),
        f"median_{prefix}_ms": float(np.median(arr)),
        f"p99_{prefix}_ms": float(np.percentile(arr, 99)),
    }


def summarize(results: list[RequestResult], duration: float, alignment: int) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ideal = sum(ideal_hits([(r.prompt_ids, r.output_ids) for r in ok], alignment))
    duration = max(duration, 1e-9)
    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "cached_tokens": cached,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "cache_hit_rate": cached / input_tokens if input_tokens else 0.0,
        "storage_hit_rate": sum(r.storage_tokens for r in ok) / input_tokens
        if input_tokens
        else 0.0,
        "ideal_hit_rate": ideal / input_tokens if input_tokens else 0.0,
        "hit_alignment": alignment,
    }
    out.update(_stats("ttft", [r.ttft for r in ok]))
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    out.update(_stats("tpot", tpots))
    out.update(_stats("itl", [x for r in ok for x in r.itls]))
    out.update(_stats("e2e_latency", [r.latency for r in ok]))
    return out


_ROWS = [
    ("Successful requests:", "completed", "{:d}"),
    ("Failed requests:", "failed", "{:d}"),
    ("Benchmark duration (s):", "duration_s", "{:.2f}"),
    ("Total input tokens:", "total_input_tokens", "{:d}"),
    ("Total generated tokens:", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s):", "request_throughput", "{:.2f}"),
    ("Input token throughput (tok/s):", "input_throughput", "{:.2f}"),
    ("Output token throughput (tok/s):", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s):", "total_throughput", "{:.2f}"),
    ("Cache hit rate:", "cache_hit_rate", "{:.4f}"),
    ("  of it from storage:", "storage_hit_rate", "{:.4f}"),
    ("Ideal hit rate:", "ideal_hit_rate", "{:.4f}"),
]
_LATENCIES = [
    ("Time to First Token", "ttft"),
    ("Time per Output Token (excl. 1st token)", "tpot"),
    ("Inter-token Latency", "itl"),
    ("End-to-End Latency", "e2e_latency"),
]


_ENGINE_ROWS = [  # only for in-process runs
    ("Computed prefill tokens:", "computed_prefill_tokens", "{:d}"),
    ("Ideal computed prefill tokens:", "ideal_computed_prefill_tokens", "{:d}"),
    ("Computed / ideal:", "computed_over_ideal", "{:.4f}"),
    ("State copies:", "state_copies", "{:d}"),
    ("Retractions:", "retractions", "{:d}"),
    ("Lost reuse (KV matched past a state):", "lost_reuse_tokens", "{:d}"),
    ("Storage loads:", "storage_loads", "{:d}"),
    ("Storage load latency, mean (ms):", "storage_load_ms", "{:.2f}"),
    ("Storage bytes read:", "storage_bytes_read", "{:d}"),
    ("Storage bytes written:", "storage_bytes_written", "{:d}"),
]


def format_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    lines = [f"{' ' + title + ' ':=^60}"]
    for label, key, fmt in _ROWS + [r for r in _ENGINE_ROWS if r[1] in s]:
        lines.append(f"{label:<44}{fmt.format(s[key]):>16}")
    for name, key in _LATENCIES:
        lines.append(f"{name:-^60}")
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize()} {key.upper().replace('_LATENCY', '')} (ms):"
            lines.append(f"{label:<44}{s[f'{stat}_{key}_ms']:>16.2f}")
    if s.get("replicas"):
        lines.append(f"{'Replicas (from /metrics)':-^60}")
        for i, rep in enumerate(s["replicas"]):
            label = f"Replica {i} hit rate ({rep['prompt_tokens']} prompt tokens):"
            lines.append(f"{label:<44}{rep['hit_rate']:>16.4f}")
    lines.append("=" * 60)
    return "\n".join(lines)


# (label, key, higher_is_better)
_COMPARE = [
    ("Request throughput (req/s)", "request_throughput", True),
    ("Output token throughput (tok/s)", "output_throughput", True),
    ("Total token throughput (tok/s)", "total_throughput", True),
    ("Mean TTFT (ms)", "mean_ttft_ms", False),
    ("P99 TTFT (ms)", "p99_ttft_ms", False),
    ("Mean TPOT (ms)", "mean_tpot_ms", False),
    ("Mean E2E latency (ms)", "mean_e2e_latency_ms", False),
    ("Cache hit rate", "cache_hit_rate", True),
    ("Ideal hit rate", "ideal_hit_rate", True),
    ("Benchmark duration (s)", "duration_s", False),
]


def comparison(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float]:
    """on / off ratio of every compared figure (0 where off is 0), and the ideal speed-up."""
    ratios = {key: (on[key] / off[key] if off[key] else 0.0) for _, key, _ in _COMPARE}
    ratios["ideal_throughput_ratio"] = ideal_speedup(on)
    return ratios


def format_comparison(on: dict[str, Any], off: dict[str, Any]) -> str:
    ratios = comparison(on, off)
    head = f"{'metric':<34}{'cache on':>12}{'cache off':>12}{'on/off':>10}"
    lines = [f"{' Radix cache on vs off ':=^68}", head, "-" * 68]
    for label, key, _ in _COMPARE:
        lines.append(f"{label:<34}{on[key]:>12.4g}{off[key]:>12.4g}{ratios[key]:>10.3f}")
    lines.append("=" * 68)
    speed = ratios["output_throughput"]
    ttft = off["mean_ttft_ms"] / on["mean_ttft_ms"] if on["mean_ttft_ms"] else 0.0
    lines.append(f"cache on: {speed:.2f}x output throughput, {ttft:.2f}x faster mean TTFT")
    ideal = ideal_speedup(on)
    lines.append(
        f"ideal on/off ratio for the workload's token counts: {ideal:.2f}x "
        f"(measured / ideal = {speed / ideal:.3f})"
    )
    return "\n".join(lines)


def format_repeats(pairs: list[dict[str, float]], ideal: float) -> str:
    """One line per cache-on / cache-off pair, then the spread of the pairs' ratios."""
    lines = [f"{' Repeats (output tok/s) ':=^68}"]
    for i, p in enumerate(pairs, 1):
        lines.append(
            f"pair {i}: on {p['on_output_throughput']:8.1f}  off {p['off_output_throughput']:8.1f}"
            f"  on/off {p['ratio']:6.3f}  (/ ideal {p['ratio'] / ideal:.3f})"
            f"  {'on' if p.get('on_first', True) else 'off'} first"
        )
    ratios = sorted(p["ratio"] for p in pairs)
    lines.append(
        f"pair ratios: min {ratios[0]:.3f}, median {ratios[(len(ratios) - 1) // 2]:.3f}, "
        f"max {ratios[-1]:.3f}; the table above compares the median run of each side"
    )
    return "\n".join(lines)


def ideal_speedup(s: dict[str, Any]) -> float:
    """Throughput ratio if time were proportional to tokens computed: (prompt + output) with
    the cache off over (prompt not ideally cached + output) with it on."""
    total = s["total_input_tokens"] + s["total_output_tokens"]
    on = s["total_input_tokens"] * (1.0 - s["ideal_hit_rate"]) + s["total_output_tokens"]
    return total / on if on else 0.0
