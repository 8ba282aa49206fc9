"""``mambaradix bench``: build a workload, play it against a server or an in-process engine,
print the figures; optionally the same workload with the radix cache off, and the ratios.

In-process (no ``--base-url``) the engine is built from the engine flags; with
``--compare-cache`` the engine and then one with ``--disable-radix-cache`` each run in a fresh
process. Over HTTP, ``--compare-base-url`` names a second server (started with the cache off).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from mambaradix.bench.client import EngineBackend, run_workload
from mambaradix.bench.plot import (
    command_caption,
    request_series,
    require_matplotlib,
    results_from_series,
    write_plot,
)
from mambaradix.bench.remote import (
    BACKENDS,
    PROMPT_FORMATS,
    RemoteBackend,
    load_bench_tokenizer,
    model_info,
    read_counters,
    replica_hit_rates,
    text_unsafe_ids,
)
from mambaradix.bench.report import (
    comparison,
    format_comparison,
    format_repeats,
    format_summary,
    ideal_speedup,
    summarize,
)
from mambaradix.bench.workloads import (
    TokenSampler,
    Workload,
    generated_shared_prefix,
    multi_turn,
    random_workload,
)
from mambaradix.config import EngineConfig, opt

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "tiny:qwen3_next:small"
DATASETS = ["generated-shared-prefix", "random", "multi-turn"]


@dataclass
class BenchConfig:
    base_url: str = opt(
        "",
        "Server or router to benchmark (any OpenAI- or SGLang-compatible one); empty runs an "
        "in-process engine built from the engine flags.",
    )
    backend: str = opt(
        "openai", "HTTP: 'openai' sends /v1/completions, 'sglang' sends /generate.", BACKENDS
    )
    prompt_format: str = opt(
        "text",
        "HTTP: 'text' sends the workload as text (what routers accept; tokens counted with "
        "--tokenizer), 'token-ids' sends token ids.",
        PROMPT_FORMATS,
    )
    tokenizer: str = opt(
        "",
        "HTTP: tokenizer folder (or tiny:<arch>) for text prompts; empty takes the "
        "tokenizer_path the server reports in /get_model_info when that folder exists here.",
    )
    replica_urls: str = opt(
        "",
        "HTTP: comma-separated replica URLs behind the router; their /metrics are read before "
        "and after the run for per-replica hit rates.",
    )
    model: str = opt("", "Model name sent to the server; empty takes the first of /v1/models.")
    api_key: str = opt("", "API key for the server (and the replicas).")
    dataset_name: str = opt("generated-shared-prefix", "Workload.", DATASETS)
    dataset_seed: int = opt(1, "Seed of the workload's token ids, lengths and arrival times.")
    num_prompts: int = opt(64, "Requests of the random workload.")
    random_input_len: int = opt(512, "Prompt length of the random workload.")
    random_output_len: int = opt(16, "Output length of the random workload.")
    random_range_ratio: float = opt(1.0, "Lengths drawn from [len * ratio, len].")
    gsp_num_groups: int = opt(4, "Groups (distinct system prompts).")
    gsp_prompts_per_group: int = opt(8, "Requests per group.")
    gsp_system_prompt_len: int = opt(512, "Shared system prompt length.")
    gsp_question_len: int = opt(64, "Per-request question length (0 = exact repeats).")
    gsp_output_len: int = opt(16, "Output length.")
    gsp_range_ratio: float = opt(1.0, "Lengths drawn from [len * ratio, len].")
    gsp_interleave: bool = opt(
        False, "Send the groups interleaved (k-th request of every group, then the next)."
    )
    mt_num_sessions: int = opt(8, "Chat sessions of the multi-turn workload.")
    mt_num_turns: int = opt(4, "Turns per session (each resends the whole history).")
    mt_system_prompt_len: int = opt(256, "System prompt shared by all sessions (0 = none).")
    mt_user_len: int = opt(64, "New user tokens per turn.")
    mt_output_len: int = opt(16, "Output length per turn.")
    mt_range_ratio: float = opt(1.0, "Lengths drawn from [len * ratio, len].")
    request_rate: float = opt(
        math.inf,
        "Sessions (requests) started per second; inf sends all at once, "
        "otherwise Poisson arrivals.",
    )
    max_concurrency: int = opt(0, "Cap on requests in flight; 0 = no cap.")
    warmup_requests: int = opt(1, "Short unrelated requests sent (untimed) before the run.")
    compare_cache: bool = opt(
        False, "In-process: run again with the radix cache off and print the ratios."
    )
    repeats: int = opt(
        5,
        "With --compare-cache: run the cache-on / cache-off pair this many times, each run in a "
        "fresh process after its warm-up (which side runs first alternates), and compare the "
        "median run of each side; the spread of the pairs' ratios is printed (a shared "
        "machine's speed drifts by 10% and more between runs).",
    )
    compare_base_url: str = opt(
        "", "HTTP: a second server (cache off) to run the same workload against."
    )
    hit_alignment: int = opt(
        0, "Snapshot alignment for the ideal hit rate; 0 = max(64, --page-size)."
    )
    output_json: str = opt("", "Write config, figures (and ratios) to this JSON file.")
    plot: str = opt(
        "",
        "Write a PNG figure of the run (both sides with --compare-cache / --compare-base-url) to "
        "this file: TTFT distributions, prompt tokens computed and the hit rate over the run, and "
        "hits from RAM vs storage when the storage tier is on. Needs matplotlib: "
        "pip install 'mambaradix[plot]'.",
    )
    disable_tqdm: bool = opt(False, "No progress bar.")


def build_workload(cfg: BenchConfig, sampler: TokenSampler) -> Workload:
    if cfg.dataset_name == "generated-shared-prefix":
        return generated_shared_prefix(
            sampler,
            cfg.gsp_num_groups,
            cfg.gsp_prompts_per_group,
            cfg.gsp_system_prompt_len,
            cfg.gsp_question_len,
            cfg.gsp_output_len,
            cfg.gsp_range_ratio,
            cfg.gsp_interleave,
        )
    if cfg.dataset_name == "random":
        return random_workload(
            sampler,
            cfg.num_prompts,
            cfg.random_input_len,
            cfg.random_output_len,
            cfg.random_range_ratio,
        )
    if cfg.dataset_name == "multi-turn":
        return multi_turn(
            sampler,
            cfg.mt_num_sessions,
            cfg.mt_num_turns,
            cfg.mt_system_prompt_len,
            cfg.mt_user_len,
            cfg.mt_output_len,
            cfg.mt_range_ratio,
        )
    raise ValueError(f"unknown --dataset-name {cfg.dataset_name!r}; choose one of {DATASETS}")


async def _play(
    cfg: BenchConfig,
    backend: Any,
    workload: Workload,
    warm: TokenSampler,
    alignment: int,
    label: str,
    on_start: Any = None,
) -> dict[str, Any]:
    for _ in range(cfg.warmup_requests):
        res = await backend.generate(warm.tokens(16), 2)
        if not res.success:
            raise RuntimeError(f"warm-up request failed: {res.error}")
    engine = getattr(backend, "engine", None)
    before = engine.stats() if engine is not None else None
    if on_start is not None:
        on_start()
    bar = tqdm(total=workload.num_requests, desc=label, disable=cfg.disable_tqdm, leave=False)
    try:
        results, duration = await run_workload(
            workload, backend, cfg.request_rate, cfg.max_concurrency, cfg.dataset_seed, bar
        )
    finally:
        bar.close()
    summary = summarize(results, duration, alignment)
    summary["requests"] = request_series(results)  # for --plot; run_benchmark moves it out
    if engine is not None:  # in-process: what the engine really computed during the run
        after = engine.stats()
        computed = after.computed_prefill_tokens - before.computed_prefill_tokens
        ideal = summary["total_input_tokens"] * (1.0 - summary["ideal_hit_rate"])
        summary["computed_prefill_tokens"] = computed
        summary["ideal_computed_prefill_tokens"] = round(ideal)
        summary["computed_over_ideal"] = computed / ideal if ideal else 0.0
        summary["state_copies"] = after.state_copies - before.state_copies
        summary["retractions"] = after.retractions - before.retractions
        summary["lost_reuse_tokens"] = after.lost_reuse_tokens - before.lost_reuse_tokens
        if engine.cache.storage is not None:
            for key in ("storage_loads", "storage_bytes_read", "storage_bytes_written"):
                summary[key] = getattr(after, key) - getattr(before, key)
            loads = summary["storage_loads"]
            seconds = after.storage_load_seconds - before.storage_load_seconds
            summary["storage_load_ms"] = 1e3 * seconds / loads if loads else 0.0
    return summary


def _samplers(cfg: BenchConfig, vocab: int, specials: set[int]) -> tuple[Workload, TokenSampler]:
    workload = build_workload(cfg, TokenSampler(vocab, cfg.dataset_seed, specials))
    return workload, TokenSampler(vocab, cfg.dataset_seed + 10_000, specials)


def _wait_idle(engine: Any, timeout: float = 10.0) -> str:
    """'ok' when the idle engine passes its integrity check, else the failure."""
    deadline = time.monotonic() + timeout
    while not engine.is_idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        engine.check_integrity()
    except Exception as e:  # reported, not fatal: the figures are still worth printing
        logger.error("engine integrity check failed after the run: %s", e)
        return f"{type(e).__name__}: {e}"
    return "ok"


def _engine_run(cfg: BenchConfig, ecfg: EngineConfig, label: str) -> dict[str, Any]:
    from mambaradix.engine.engine import Engine  # the engine is heavy: import on use

    with Engine(ecfg) as engine:
        tok = engine.tokenizer
        specials = set(getattr(tok, "all_special_ids", []) or [])
        workload, warm = _samplers(cfg, len(tok), specials)
        alignment = cfg.hit_alignment or max(64, ecfg.page_size)
        backend = EngineBackend(engine)
        summary = asyncio.run(_play(cfg, backend, workload, warm, alignment, label))
        summary["integrity"] = _wait_idle(engine)
    return summary


def _fresh_process_run(cfg: BenchConfig, ecfg: EngineConfig, label: str) -> dict[str, Any]:
    """``_engine_run`` in a new process, so that the two runs of a comparison start alike (a
    second engine in the same process ran the same workload ~15% slower, which would have
    flattered the cache)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_engine_run, cfg, ecfg, label).result()


def _compare_runs(
    cfg: BenchConfig, ecfg: EngineConfig
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, float]]]:
    """``--repeats`` cache-on / cache-off pairs, each run in a fresh process, the side that runs
    first alternating from pair to pair. Returns the median-throughput run of each side and
    every pair's figures."""
    if cfg.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    off_cfg = dataclasses.replace(ecfg, disable_radix_cache=True)
    ons, offs, pairs = [], [], []
    for i in range(cfg.repeats):
        tag = f" {i + 1}/{cfg.repeats}" if cfg.repeats > 1 else ""
        # odd pairs run cache off first: whichever side runs first in a pair gets no edge
        order = [(ecfg, "cache on", ons), (off_cfg, "cache off", offs)]
        for ec, label, runs in order[:: -1 if i % 2 else 1]:
            runs.append(_fresh_process_run(cfg, ec, label + tag))
        on_t, off_t = ons[-1]["output_throughput"], offs[-1]["output_throughput"]
        pairs.append(
            {"on_output_throughput": on_t, "off_output_throughput": off_t,
             "ratio": on_t / off_t if off_t else 0.0, "on_first": i % 2 == 0}
        )  # fmt: skip

    def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return sorted(runs, key=lambda r: r["output_throughput"])[(len(runs) - 1) // 2]

    return median_run(ons), median_run(offs), pairs


async def _http_run(cfg: BenchConfig, base_url: str, ecfg: EngineConfig, label: str) -> dict:
    info = await model_info(base_url, cfg.api_key)
    tok = None
    if cfg.prompt_format == "text" or cfg.tokenizer:
        tok = load_bench_tokenizer(cfg.tokenizer, info)
    backend = RemoteBackend(base_url, cfg.backend, cfg.prompt_format, tok, cfg.model, cfg.api_key)
    replicas = [u.strip() for u in cfg.replica_urls.split(",") if u.strip()]
    try:
        card = await _model_card(backend, cfg.model)
        backend.model = backend.model or str(card.get("id") or "")
        vocab = len(tok) if tok is not None else int(card.get("vocab_size") or 0)
        if vocab <= 0:
            raise RuntimeError(
                f"{base_url}/v1/models does not report vocab_size; token-id prompts need it "
                "(or pass --tokenizer)"
            )
        specials = set(getattr(tok, "all_special_ids", []) or []) if tok is not None else set()
        if cfg.prompt_format == "text":
            specials |= text_unsafe_ids(tok, vocab)
        workload, warm = _samplers(cfg, vocab, specials)
        alignment = cfg.hit_alignment or max(64, ecfg.page_size)
        before: list[dict[str, float]] = []

        def on_start() -> None:
            before.extend(read_counters(u, cfg.api_key) for u in replicas)

        summary = await _play(cfg, backend, workload, warm, alignment, label, on_start)
        if replicas:
            after = [read_counters(u, cfg.api_key) for u in replicas]
            summary["replicas"] = replica_hit_rates(replicas, before, after)
        return summary
    finally:
        await backend.aclose()


async def _model_card(backend: RemoteBackend, model: str) -> dict[str, Any]:
    r = await backend.client.get(backend.base_url + "/v1/models")
    if r.status_code != 200:
        raise RuntimeError(f"{backend.base_url}/v1/models answered HTTP {r.status_code}")
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{backend.base_url} serves no model")
    return next((c for c in data if model and c.get("id") == model), data[0])


def run_benchmark(
    cfg: BenchConfig, ecfg: EngineConfig | None = None, out: TextIO | None = None
) -> dict[str, Any]:
    """Run, write the fixed-format figures to ``out`` (default stdout) and return
    ``{"config", "results", "cache_off"?, "ratios"?, "repeats"?, "requests"}`` (``results``:
    the main run; ``requests``: each side's per-request series, label -> lists); with
    ``--plot`` also draw them (``bench.plot``)."""
    ecfg = ecfg or EngineConfig()
    if cfg.plot:
        require_matplotlib()  # fail before the run, not after it
    report: dict[str, Any] = {"config": {"bench": dataclasses.asdict(cfg)}}
    off = None
    if cfg.base_url:
        results = asyncio.run(_http_run(cfg, cfg.base_url, ecfg, "bench"))
        if cfg.compare_base_url:
            off = asyncio.run(_http_run(cfg, cfg.compare_base_url, ecfg, "compare"))
    else:
        if not ecfg.model_path:
            ecfg = dataclasses.replace(ecfg, model_path=DEFAULT_MODEL)
        report["config"]["engine"] = dataclasses.asdict(ecfg)
        if cfg.compare_cache:
            results, off, pairs = _compare_runs(cfg, ecfg)
            report["repeats"] = pairs
        else:
            results = _engine_run(cfg, ecfg, "bench")
    report["results"] = results
    title = f"{cfg.dataset_name} @ {cfg.base_url or ecfg.model_path}"
    if cfg.base_url:  # a server's cache setting is not known here unless it is compared
        on_label = "cache on" if off is not None else "this run"
    else:
        on_label = "cache off" if ecfg.disable_radix_cache else "cache on"
    series = {on_label: results.pop("requests")}
    if off is not None:
        series["cache off"] = off.pop("requests")
    report["requests"] = series  # per request, in start order: the figure's data
    text = [format_summary(results, title)]
    if off is not None:
        report["cache_off"] = off
        report["ratios"] = comparison(results, off)
        text += [format_summary(off, title + " (cache off)"), format_comparison(results, off)]
        if len(report.get("repeats", [])) > 1:
            text.append(format_repeats(report["repeats"], ideal_speedup(results)))
    out = out or sys.stdout
    out.write("\n".join(text) + "\n")
    out.flush()
    if cfg.output_json:
        with open(cfg.output_json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        logger.info("wrote %s", cfg.output_json)
    if cfg.plot:
        runs = {label: results_from_series(s) for label, s in series.items()}
        storage = ecfg.enable_hierarchical_cache if not cfg.base_url else None
        caption = command_caption([cfg] if cfg.base_url else [ecfg, cfg])
        write_plot(cfg.plot, runs, storage, title, caption)
        out.write(f"plot written to {cfg.plot}\n")
        out.flush()
    return report
