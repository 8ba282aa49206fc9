"""``bench --plot``: the figure from synthetic request results (panels, PNG written and read
back, the tier panel only with the storage tier), the series round trip, the missing-matplotlib
error. The in-process ``mambaradix bench --compare-cache --plot`` on the tiny model is part of
``test_bench_e2e.py::test_cli_bench_compare_cache`` (one CLI run checks both)."""

from __future__ import annotations

import builtins
import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:  # a test dependency (the test extra): missing is a failure, never a skip
    import matplotlib  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.fail("matplotlib is missing: pip install -e '.[test]'", pytrace=False)

from matplotlib import image as mpimg  # noqa: E402

from mambaradix.bench import plot  # noqa: E402
from mambaradix.bench.client import RequestResult  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _results(n: int, cached: int, storage: int = 0, ttft: float = 0.01) -> list[RequestResult]:
    """n requests of 100 prompt tokens; all but the first hit ``cached`` tokens, ``storage``
    of them from the storage tier."""
    return [
        RequestResult(start=0.01 * i, ttft=ttft * (1 + i % 3), prompt_len=100, output_len=4,
                      cached_tokens=cached if i else 0, storage_tokens=storage if i else 0,
                      latency=0.05, success=True)
        for i in range(n)
    ]  # fmt: skip


def _titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


def test_figure_panels_cache_on_vs_off_without_tier() -> None:
    runs = {"cache on": _results(8, 60), "cache off": _results(8, 0, ttft=0.03)}
    fig = plot.make_figure(runs, storage=False, title="gsp @ tiny", caption="cmd")
    assert _titles(fig) == [plot.TTFT_TITLE, plot.COMPUTED_TITLE, plot.HIT_RATE_TITLE]
    assert not any(plot.TIER_TITLE in t for t in _titles(fig))  # negative control: tier off
    ttft, computed, hit = fig.axes
    assert [line.get_label().split(" (")[0] for line in ttft.get_lines()] == list(runs)
    assert ttft.get_xlabel() == "TTFT (ms)" and computed.get_ylabel() == "tokens computed"
    # computed = prompt - cached per request; the off side recomputes every prompt
    on_line, off_line = computed.get_lines()
    assert list(on_line.get_ydata()) == [100] + [40] * 7
    assert list(off_line.get_ydata()) == [100] * 8
    assert "total 380" in on_line.get_label() and "total 800" in off_line.get_label()
    # cumulative hit rate: 7 * 60 / 800 at the end, 0 for cache off
    on_rate, off_rate = hit.get_lines()
    assert on_rate.get_ydata()[-1] == pytest.approx(420 / 800) and on_rate.get_ydata()[0] == 0
    assert max(off_rate.get_ydata()) == 0
    assert fig._suptitle.get_text() == "gsp @ tiny" and fig._supxlabel.get_text() == "cmd"


def test_tier_panel_only_with_storage() -> None:
    with_storage = plot.make_figure({"cache on": _results(6, 60, storage=20)})
    assert _titles(with_storage)[3] == f"{plot.TIER_TITLE} (cache on)"
    tier = with_storage.axes[3]
    labels = tier.get_legend_handles_labels()[1]
    # 5 hitting requests: 5 * 40 from RAM, 5 * 20 from storage
    assert labels == ["from RAM (total 200)", "from storage (total 100)"]
    # inferred from the data: no storage hits, no tier panel (negative control)
    assert len(plot.make_figure({"cache on": _results(6, 60)}).axes) == 3
    # the tier was on but served nothing from storage: the panel says so
    on_no_hits = plot.make_figure({"cache on": _results(6, 60)}, storage=True)
    assert on_no_hits.axes[3].get_legend_handles_labels()[1][1] == "from storage (total 0)"


def test_write_plot_png_reads_back(tmp_path) -> None:
    path = tmp_path / "bench.png"
    fig = plot.write_plot(str(path), {"cache on": _results(8, 60, storage=10)}, caption="c")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = mpimg.imread(str(path)).shape[:2]
    w_in, h_in = fig.get_size_inches()
    assert (width, height) == (round(w_in * 100), round(h_in * 100))


def test_series_round_trip_keeps_successes_in_start_order() -> None:
    res = _results(4, 60, storage=5)[::-1] + [RequestResult(start=0.5, success=False)]
    series = plot.request_series(res)
    assert json.loads(json.dumps(series)) == series  # what the child process returns
    assert series["start"] == sorted(series["start"]) and len(series["start"]) == 4
    back = plot.results_from_series(series)
    assert [(r.prompt_len, r.cached_tokens, r.storage_tokens) for r in back] == [
        (100, 0, 0), (100, 60, 5), (100, 60, 5), (100, 60, 5)
    ]  # fmt: skip


def test_missing_matplotlib_names_the_extra(monkeypatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(RuntimeError, match=r"pip install 'mambaradix\[plot\]'"):
        plot.make_figure({"cache on": _results(2, 0)})


def test_caption_names_the_changed_flags() -> None:
    from mambaradix.bench.runner import BenchConfig
    from mambaradix.config import EngineConfig

    ecfg = EngineConfig(model_path="tiny:qwen3_next", enable_hierarchical_cache=True)
    caption = plot.command_caption([ecfg, BenchConfig(repeats=1, compare_cache=True, plot="x")])
    assert caption.endswith(
        "mambaradix bench --model-path tiny:qwen3_next --enable-hierarchical-cache "
        "--compare-cache --repeats 1"
    )  # defaults and --plot itself left out
    assert ", commit " in caption and caption[:4].isdigit()
    fig = plot.make_figure({"cache on": _results(2, 0)}, caption=caption * 3)
    assert all(len(ln) <= 16 * 14 for ln in fig._supxlabel.get_text().splitlines())
