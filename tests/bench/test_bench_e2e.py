"""The benchmark end to end on the real engine: CLI in-process with cache on/off (and its
``--plot``), HTTP multi-turn (outputs resent token for token), Poisson arrivals under a
concurrency cap."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mambaradix.bench.client import EngineBackend, run_workload  # noqa: E402
from mambaradix.bench.remote import RemoteBackend  # noqa: E402
from mambaradix.bench.report import summarize  # noqa: E402
from mambaradix.bench.workloads import TokenSampler, multi_turn, random_workload  # noqa: E402
from mambaradix.cli import main  # noqa: E402
from mambaradix.config import ServerConfig  # noqa: E402
from mambaradix.engine.engine import Engine  # noqa: E402
from mambaradix.server.launch import ServerThread  # noqa: E402

SMALL_POOLS = ["--max-total-tokens", "8192", "--max-mamba-cache-size", "64"]


def test_cli_bench_compare_cache(tmp_path, capsys) -> None:
    """Also the one CLI run of ``--plot`` (each side's series, the figure; the figure itself
    from synthetic results: test_plot.py): four fresh processes are enough for both."""
    from matplotlib import image as mpimg

    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--model-path", "tiny:qwen3_next", *SMALL_POOLS,
            "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
            "--gsp-system-prompt-len", "130", "--gsp-question-len", "8",
            "--gsp-output-len", "3", "--compare-cache", "--repeats", "2", "--disable-tqdm",
            "--debug-integrity",
            "--output-json", str(out), "--plot", str(png)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Radix cache on vs off" in printed and "Ideal hit rate" in printed
    assert f"plot written to {png}" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert mpimg.imread(str(png)).shape[:2] == (480, 1600)  # three panels: tier off
    report = json.loads(out.read_text())
    on, off = report["results"], report["cache_off"]
    for r in (on, off):
        assert r["completed"] == 6 and r["failed"] == 0 and r["integrity"] == "ok"
        assert r["total_input_tokens"] == 6 * 138 and r["total_output_tokens"] == 18
    # all six arrive together: every request but the first of its group resumes at 128
    ideal = 4 * 128 / (6 * 138)
    assert on["ideal_hit_rate"] == pytest.approx(ideal) == off["ideal_hit_rate"]
    assert on["cache_hit_rate"] == pytest.approx(ideal)
    assert off["cache_hit_rate"] == 0.0  # negative control: the cache really was off
    assert report["ratios"]["output_throughput"] > 0
    assert report["config"]["engine"]["model_path"] == "tiny:qwen3_next"
    # --repeats 2: two pairs, the second running cache off first; each side reports its
    # median (lower of two) run
    pairs = report["repeats"]
    assert len(pairs) == 2 and "pair ratios: min" in printed
    assert [p["on_first"] for p in pairs] == [True, False] and "off first" in printed
    assert on["output_throughput"] == min(p["on_output_throughput"] for p in pairs)
    assert off["output_throughput"] == min(p["off_output_throughput"] for p in pairs)
    for p in pairs:
        assert p["ratio"] == pytest.approx(p["on_output_throughput"] / p["off_output_throughput"])
    # --plot's data: each side's per-request series (of its median run), out of the summaries
    series = report["requests"]
    assert list(series) == ["cache on", "cache off"]
    assert "requests" not in on and "requests" not in off
    for side, s in series.items():
        assert len(s["ttft"]) == 6 and all(t > 0 for t in s["ttft"]), side
        assert s["prompt_len"] == [138] * 6
    assert sum(series["cache on"]["cached"]) == on["cached_tokens"] > 0
    assert sum(series["cache off"]["cached"]) == 0


@pytest.fixture(scope="module")
def engine():
    with Engine(
        model_path="tiny:qwen3_next",
        max_total_tokens=16384,
        max_mamba_cache_size=64,
        debug_integrity=True,
    ) as e:
        yield e


def test_http_multi_turn_resends_history(engine) -> None:
    wl = multi_turn(TokenSampler(len(engine.tokenizer), seed=5, exclude={0, 1, 2}),
                    num_sessions=2, num_turns=3, system_prompt_len=0, user_len=40,
                    output_len=6)  # fmt: skip

    async def go():
        backend = RemoteBackend(st.base_url + "/v1", "openai", "token-ids")
        try:
            return await run_workload(wl, backend, max_concurrency=2)
        finally:
            await backend.aclose()

    with ServerThread(engine, ServerConfig(port=0)) as st:
        results, duration = asyncio.run(go())
    assert len(results) == 6 and all(r.success for r in results)
    by = {(r.session, r.turn): r for r in results}
    for (s, t), r in by.items():
        assert len(r.output_ids) == r.output_len == 6
        if t == 0:
            assert r.cached_tokens == 0  # negative control: nothing to reuse yet
            continue
        prev = by[(s, t - 1)]
        history = prev.prompt_ids + prev.output_ids
        assert r.prompt_ids[: len(history)] == history  # resent token for token
        assert r.cached_tokens >= len(history) - 1, (s, t, r.cached_tokens, len(history))
    summary = summarize(results, duration, alignment=64)
    assert 0 < summary["cache_hit_rate"] <= summary["ideal_hit_rate"] + 1e-9


def test_poisson_arrivals_respect_concurrency_cap(engine) -> None:
    wl = random_workload(TokenSampler(len(engine.tokenizer), seed=9, exclude={0, 1, 2}),
                         num_prompts=8, input_len=70, output_len=4, range_ratio=0.5)  # fmt: skip
    inner = EngineBackend(engine)
    state = {"now": 0, "peak": 0}

    class Counting:
        async def generate(self, ids, n):
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            try:
                return await inner.generate(ids, n)
            finally:
                state["now"] -= 1

    results, duration = asyncio.run(
        run_workload(wl, Counting(), request_rate=40.0, max_concurrency=2, seed=3)
    )
    assert len(results) == 8 and all(r.success for r in results)
    assert state["peak"] == 2
    s = summarize(results, duration, alignment=64)
    assert s["ideal_hit_rate"] == 0.0 and s["cache_hit_rate"] == 0.0  # no sharing, no hits
    assert s["mean_ttft_ms"] > 0 and s["p99_itl_ms"] >= s["median_itl_ms"] > 0


def test_cli_generate(capsys) -> None:
    argv = ["generate", "--model-path", "tiny:qwen3_next", *SMALL_POOLS,
            "--prompt", "hello", "--max-new-tokens", "5", "--ignore-eos"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    meta = json.loads(captured.err.strip().splitlines()[-1])
    assert meta["completion_tokens"] == 5 and meta["finish_reason"] == "length"
