"""``mambaradix bench --plot FILE.png``: one figure of a benchmark's per-request series.

Panels (each run, e.g. cache on and cache off, drawn on the same axes):

- TTFT distribution: the empirical CDF of time to first token;
- prompt tokens computed per request (prompt - cached), in the order requests started;
- the cumulative hit rate over the run: sum(cached) / sum(prompt) of the requests so far;
- hit tokens by tier (the first run only, when the storage tier was on): cumulative tokens
  reused from RAM (cached - storage) and read back from storage.

matplotlib is an optional extra (``pip install 'mambaradix[plot]'``), imported on use; the
figure is drawn on the Agg canvas, without pyplot's global state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import subprocess
import textwrap
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mambaradix.bench.client import RequestResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'mambaradix[plot]'"
TTFT_TITLE = "TTFT distribution"
COMPUTED_TITLE = "Prompt tokens computed per request"
HIT_RATE_TITLE = "Cumulative cache hit rate"
TIER_TITLE = "Hit tokens by tier"


def require_matplotlib() -> None:
    """Raise a clear error (with the install command) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"--plot needs matplotlib: {INSTALL_HINT}") from e


def request_series(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """The successful requests' figures the plot needs, in start order, as compact lists
    (what a ``--compare-cache`` child process returns beside its summary)."""
    ok = sorted((r for r in results if r.success), key=lambda r: r.start)
    return {
        "start": [round(r.start, 5) for r in ok],
        "ttft": [round(r.ttft, 6) for r in ok],
        "prompt_len": [r.prompt_len for r in ok],
        "cached": [r.cached_tokens for r in ok],
        "storage": [r.storage_tokens for r in ok],
    }


def results_from_series(series: Mapping[str, Sequence[float]]) -> list[RequestResult]:
    """The inverse of ``request_series`` (only the plotted fields are filled)."""
    cols = zip(
        series["start"], series["ttft"], series["prompt_len"], series["cached"], series["storage"]
    )
    return [
        RequestResult(start=s, ttft=t, prompt_len=int(p), cached_tokens=int(c),
                      storage_tokens=int(st), success=True)
        for s, t, p, c, st in cols
    ]  # fmt: skip


def make_figure(
    runs: Mapping[str, Sequence[RequestResult]],
    storage: bool | None = None,
    title: str = "",
    caption: str = "",
) -> Figure:
    """The figure of ``runs`` (label -> results; the first is the main run). ``storage``: the
    storage tier was on (None: it was if any request read tokens back from it); the tier panel
    is drawn only then. ``title`` above the panels, ``caption`` (command, commit) below them."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("nothing to plot: no runs")
    ok = {
        label: sorted((r for r in res if r.success), key=lambda r: r.start)
        for label, res in runs.items()
    }
    main_label, main = next(iter(ok.items()))
    if storage is None:
        storage = any(r.storage_tokens for r in main)
    panels = 4 if storage else 3
    fig = Figure(figsize=(12, 8.6) if storage else (16, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel() if storage else fig.subplots(1, 3)
    ax_ttft, ax_computed, ax_hit = axes[:3]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for i, (label, res) in enumerate(ok.items()):
        color = colors[i % len(colors)]
        _ttft_cdf(ax_ttft, res, label, color)
        order = list(range(1, len(res) + 1))
        computed = [r.prompt_len - r.cached_tokens for r in res]
        ax_computed.plot(
            order, computed, color=color, marker="." if len(res) <= 200 else None,
            linewidth=1, label=f"{label} (total {sum(computed):,})",
        )  # fmt: skip
        prompt = cached = 0
        rate = []
        for r in res:
            prompt += r.prompt_len
            cached += r.cached_tokens
            rate.append(cached / prompt if prompt else 0.0)
        final = rate[-1] if rate else 0.0
        ax_hit.plot(order, rate, color=color, label=f"{label} (final {final:.3f})")
    ax_ttft.set(title=TTFT_TITLE, xlabel="TTFT (ms)", ylabel="fraction of requests")
    ax_ttft.set_ylim(0, 1.02)
    ax_computed.set(
        title=COMPUTED_TITLE, xlabel="request (in order of start)", ylabel="tokens computed"
    )
    ax_computed.set_ylim(bottom=0)
    ax_hit.set(title=HIT_RATE_TITLE, xlabel="request (in order of start)",
               ylabel="cached / prompt tokens so far")  # fmt: skip
    ax_hit.set_ylim(0, 1.02)
    if storage:
        _tiers(axes[3], main, main_label)
    for ax in axes[:panels]:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    if caption:  # constrained layout keeps room for it below the panels, wrapped to fit
        width = int(fig.get_figwidth() * 14)  # characters of small text per line
        text = textwrap.fill(caption, width, break_on_hyphens=False, break_long_words=False)
        fig.supxlabel(text, fontsize="small", color="dimgray")
    return fig


def _ttft_cdf(ax: Any, res: Sequence[RequestResult], label: str, color: str) -> None:
    ttfts = sorted(1e3 * r.ttft for r in res)
    if not ttfts:
        return
    frac = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
    median = ttfts[(len(ttfts) - 1) // 2]
    ax.step(ttfts, frac, where="post", color=color, label=f"{label} (median {median:.1f} ms)")


def _tiers(ax: Any, res: Sequence[RequestResult], label: str) -> None:
    order = list(range(1, len(res) + 1))
    ram, disk, ram_sum, disk_sum = [], [], 0, 0
    for r in res:
        ram_sum += r.cached_tokens - r.storage_tokens
        disk_sum += r.storage_tokens
        ram.append(ram_sum)
        disk.append(disk_sum)
    ax.stackplot(
        order, ram, disk, colors=["tab:blue", "tab:purple"], alpha=0.7,
        labels=[f"from RAM (total {ram_sum:,})", f"from storage (total {disk_sum:,})"],
    )  # fmt: skip
    ax.set(title=f"{TIER_TITLE} ({label})", xlabel="request (in order of start)",
           ylabel="hit tokens so far")  # fmt: skip


def write_plot(
    path: str,
    runs: Mapping[str, Sequence[RequestResult]],
    storage: bool | None = None,
    title: str = "",
    caption: str = "",
) -> Figure:
    """``make_figure`` saved as a PNG at ``path``; returns the figure."""
    fig = make_figure(runs, storage, title, caption)
    fig.savefig(path, format="png", dpi=100)
    logger.info("wrote %s", path)
    return fig


def command_caption(configs: Sequence[Any]) -> str:
    """Date, commit, CPU model and the command: ``mambaradix bench`` with the flags of the
    config dataclasses ``configs`` that differ from their defaults."""
    flags = []
    for c in configs:
        for f in dataclasses.fields(c):
            value = getattr(c, f.name)
            if value == f.default or f.name in ("plot", "output_json", "disable_tqdm"):
                continue
            flag = "--" + f.name.replace("_", "-")
            flags.append(flag if value is True else f"{flag} {value}")
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    head = f"{time.strftime('%Y-%m-%d')}, commit {commit or 'unknown'}, {_cpu_model()}"
    return f"{head}: mambaradix bench {' '.join(flags)}".rstrip()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
