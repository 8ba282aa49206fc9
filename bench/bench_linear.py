"""bf16 projections at decode batch sizes: the native kernel (``kernels/csrc/linear.c``)
against torch's matmul, as read bandwidth, beside a streaming read of the same bytes.

For each projection shape of the real-size presets and each batch of M rows it prints the
median time of both and the GB/s of weight bytes they reach (every shape runs natively here);
``cpu.LINEAR_NATIVE_MAX_ROWS`` and ``LINEAR_NATIVE_X_BYTES`` are set where torch starts to win.
Each call reads a different copy of the weight (together larger than the last-level cache), so
the figures are memory reads as in a decode step, not cache hits.

    python bench/bench_linear.py
    python bench/bench_linear.py --rows 1 2 4 8 16 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mambaradix.kernels import cpu

# (in, out) of Granite-4.0-H-350M (Mamba2 in/out, MLP in/out, the tied LM head) and
# Qwen3.5-0.8B's MLP down projection
SHAPES = [(768, 3352), (1536, 768), (768, 4096), (2048, 768), (3584, 1024), (768, 100352)]
COPIES_BYTES = 256 << 20  # weight copies per shape, together beyond the last-level cache


def timed(fn, ws: list[torch.Tensor], x: torch.Tensor, reps: int) -> float:
    times = []
    for i in range(reps):
        w = ws[i % len(ws)]
        t = time.perf_counter()
        fn(x, w, None)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def stream_gbs(nbytes: int) -> float:
    """A plain read of ``nbytes`` (torch.sum of fp32, best of 5), GB/s."""
    t = torch.ones(nbytes // 4)
    best = min(_time(t.sum) for _ in range(5))
    return nbytes / best / 1e9


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=0, help="0: every core")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the native kernels share torch's OpenMP pool
    print(f"threads {torch.get_num_threads()}; streaming read {stream_gbs(1 << 30):.1f} GB/s; "
          f"the engine runs native up to {cpu.LINEAR_NATIVE_MAX_ROWS} rows of at most "
          f"{cpu.LINEAR_NATIVE_X_BYTES} bytes together")  # fmt: skip
    limits = cpu.LINEAR_NATIVE_MAX_ROWS, cpu.LINEAR_NATIVE_X_BYTES
    cpu.LINEAR_NATIVE_MAX_ROWS, cpu.LINEAR_NATIVE_X_BYTES = max(args.rows), 1 << 40
    try:
        for k, n in SHAPES:
            nbytes = k * n * 2
            ws = [(torch.randn(n, k) / k**0.5).bfloat16()
                  for _ in range(max(2, COPIES_BYTES // nbytes))]  # fmt: skip
            for m in args.rows:
                x = torch.randn(m, k).bfloat16()
                ours = timed(cpu.linear, ws, x, args.reps)
                theirs = timed(F.linear, ws, x, args.reps)
                print(
                    f"{k:>5} -> {n:<6} M={m:<3} native {ours * 1e6:8.0f} us "
                    f"({nbytes / ours / 1e9:5.1f} GB/s)  torch {theirs * 1e6:8.0f} us "
                    f"({nbytes / theirs / 1e9:5.1f} GB/s)  torch/native {theirs / ours:5.2f}"
                )
    finally:
        cpu.LINEAR_NATIVE_MAX_ROWS, cpu.LINEAR_NATIVE_X_BYTES = limits


if __name__ == "__main__":
    main()
