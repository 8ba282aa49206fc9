"""bf16 matmuls of many rows (prefill chunks, large decode batches) on the CPU: torch's bf16
matmul, or the same product computed from fp32 copies where this CPU's fp32 matmul is faster.

Why: CPUs with AVX-512 BF16 but without AMX (Intel Xeons whose hypervisor hides AMX) run the
bf16 dot-product instruction at half the rate of fp32 fused multiply-adds, so oneDNN's bf16
matmul reached 148 GFLOP/s on such a 2-core machine where MKL's fp32 matmul of the same shape
reached 268 (a 512 x 1,024 x 6,912 linear: 149 against 218 GFLOP/s with the conversions
included). On AMD Zen 4 the bf16 matmul is the faster one. Both give the same product up to the
order of the fp32 sums: a bf16 x bf16 product is exact in fp32, both accumulate in fp32, add
the bias in fp32 and round once to bf16.

Which one runs is measured once per process, on the first call that could use either (the
engine's warm-up pays it, ~0.2 s; on an x86 CPU without bf16 instructions, where torch's bf16
matmul is a fallback, fp32 without measuring: that took ~2 s there), unless
``$MAMBARADIX_BF16_MATMUL`` names one (``bf16`` or ``fp32``; ``auto`` decides). The fp32 path
converts the weight in blocks of at most ``BLOCK_BYTES`` so a large matrix never holds a whole
fp32 copy. The same choice sends decode batches of tens of rows (``kernels.cpu``: from
``LINEAR_TILES_MIN_ROWS`` to ``MIN_ROWS``) to a C kernel that widens the weights to fp32 in
registers, or to torch's bf16 matmul.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MODES = ("auto", "bf16", "fp32")
MIN_ROWS = 128  # below, the weight's conversion costs more than fp32 gains (64 rows: even)
BLOCK_BYTES = 32 << 20  # the most an fp32 copy of weight rows may take at once
MARGIN = 0.9  # fp32 runs only where it took under this share of the bf16 matmul's time

_lock = threading.Lock()
_choice: str | None = None  # "bf16" or "fp32" once decided


def set_mode(mode: str) -> None:
    """Force a path (``bf16``, ``fp32``) or measure again on the next call (``auto``)."""
    global _choice
    if mode not in MODES:
        raise ValueError(f"bf16 matmul mode {mode!r}: expected one of {', '.join(MODES)}")
    _choice = None if mode == "auto" else mode


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bf16 ``x`` [..., K] and ``weight`` [N, K] computed in fp32, rounded once."""
    rows = x.reshape(-1, x.shape[-1]).float()
    n, k = weight.shape
    step = max(1, BLOCK_BYTES // (4 * k))
    if step >= n:
        out = F.linear(rows, weight.float(), None if bias is None else bias.float())
    else:
        out = rows.new_empty(rows.shape[0], n)
        for n0 in range(0, n, step):
            b = None if bias is None else bias[n0 : n0 + step].float()
            out[:, n0 : n0 + step] = F.linear(rows, weight[n0 : n0 + step].float(), b)
    return out.to(torch.bfloat16).view(*x.shape[:-1], n)


def _measure() -> str:
    """The faster path on a prefill-shaped product, alternated four times, best of each."""
    x = torch.randn(512, 1024).to(torch.bfloat16)
    w = (torch.randn(2048, 1024) * 0.03).to(torch.bfloat16)
    best = {"bf16": float("inf"), "fp32": float("inf")}
    runs = {"bf16": lambda: F.linear(x, w), "fp32": lambda: linear_fp32(x, w, None)}
    for fn in runs.values():
        fn()  # first calls build primitives and grow the heap
    for _ in range(4):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    flops = 2 * 512 * 1024 * 2048
    picked = decide(best["bf16"], best["fp32"])
    logger.info(
        "bf16 matmuls of >= %d rows run %s: torch's bf16 matmul %.0f GFLOP/s, fp32 from bf16 "
        "copies %.0f GFLOP/s on this CPU ($MAMBARADIX_BF16_MATMUL=bf16|fp32 fixes the choice)",
        MIN_ROWS, "in fp32" if picked == "fp32" else "as bf16",
        flops / best["bf16"] / 1e9, flops / best["fp32"] / 1e9,
    )  # fmt: skip
    return picked


def decide(bf16_s: float, fp32_s: float) -> str:
    """The path to run from the two measured times: fp32 only by a clear margin."""
    return "fp32" if fp32_s < MARGIN * bf16_s else "bf16"


def choice() -> str:
    """``bf16`` or ``fp32``: forced by ``set_mode`` or the environment, else measured once."""
    global _choice
    if _choice is None:
        with _lock:
            if _choice is None:
                env = os.environ.get("MAMBARADIX_BF16_MATMUL", "auto").strip().lower()
                if env not in MODES:
                    raise ValueError(
                        f"MAMBARADIX_BF16_MATMUL={env!r}: expected one of {', '.join(MODES)}"
                    )
                _choice = _auto() if env == "auto" else env
    return _choice


def _auto() -> str:
    """fp32 without measuring on an x86 CPU without bf16 instructions, else measured."""
    from mambaradix.kernels import cpu_features

    if cpu_features.x86_without_bf16():
        logger.info(
            "bf16 matmuls of >= %d rows run in fp32: no bf16 instructions on this CPU "
            "($MAMBARADIX_BF16_MATMUL=bf16|fp32 fixes the choice)",
            MIN_ROWS,
        )
        return "fp32"
    return _measure()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bf16 CPU tensors of ``MIN_ROWS`` or more rows by the faster path."""
    if x.numel() >= MIN_ROWS * x.shape[-1] and choice() == "fp32":
        return linear_fp32(x, weight, bias)
    return F.linear(x, weight, bias)
