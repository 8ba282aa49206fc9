"""One attention layer of a prefill chunk over a cached prefix, alone: the native kernel
(``kernels.cpu.attention_prefill``, ``csrc/attention_prefill.c``) against the torch reference
(``kernels.attention.attention_prefill``: ATen's flash kernel and its cascades), alternated in
one process, each figure the best of ``--rounds``; and both against torch's bf16 matmul rate,
read in the same run (a 2,048-square matmul). FLOPs count the scores and the weighted values
of every visible key (4 x D per query head and key, D = the head size). The native kernel's
gather buffers are allocated by its first call and reused, as a forward's layers share them.

Head shapes (query / KV heads x head size): Qwen3.5 8 / 2 x 256, Granite-4.0-H 12 / 4 x 64,
LFM2 16 / 8 x 64. bf16 pools, the keys at random slots of a pool 10% larger.

    python bench/bench_prefill_attention.py [--prefixes 0 1536 16384] [--chunk 512]
        [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_models import _best  # noqa: E402

SHAPES = {"qwen3_5": (8, 2, 256), "granite_4_0_h": (12, 4, 64), "lfm2": (16, 8, 64)}


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0, 1536, 16384])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    mm = 2 * 2048**3 / _best(lambda: torch.matmul(a, a), args.rounds)
    print(f"# threads={args.threads} bf16_matmul_GFLOP_s={mm / 1e9:.0f}", flush=True)
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        for pre in args.prefixes:
            measure(shape, pre, args, g, mm)


def measure(shape: str, pre: int, args, g: torch.Generator, mm: float) -> None:
    from mambaradix.kernels import attention, cpu

    hq, hkv, d = SHAPES[shape]
    n = args.chunk
    size = (pre + n) * 11 // 10
    k_pool = torch.randn(size, hkv, d, generator=g).bfloat16()
    v_pool = torch.randn(size, hkv, d, generator=g).bfloat16()
    slots = torch.randperm(size, generator=g)[: pre + n]
    q = torch.randn(n, hq, d, generator=g).bfloat16()
    keys = cpu.PrefillKeys(
        torch.tensor([0, n]), torch.tensor([pre]), torch.tensor([0, pre + n]), slots, pre + n
    )
    scale = d**-0.5
    runs = {
        "native": lambda: cpu.attention_prefill(q, k_pool, v_pool, keys, scale),
        "reference": lambda: attention.attention_prefill(q, k_pool, v_pool, slots, pre, scale),
    }
    assert runs["native"]() is not None, "the native kernel does not apply here"
    best = dict.fromkeys(runs, float("inf"))
    for r in range(args.rounds):  # alternated, the first side swapping each round
        for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
            best[name] = min(best[name], seconds(runs[name]))
    flops = 4 * d * hq * n * (pre + (n + 1) / 2)
    body = " ".join(
        f"{m}_ms={s * 1e3:.1f} {m}_GFLOP_s={flops / s / 1e9:.0f}" for m, s in best.items()
    )
    print(
        f"shape={shape} heads={hq}/{hkv}x{d} prefix={pre} chunk={n} {body} "
        f"speedup={best['reference'] / best['native']:.2f} "
        f"native_of_matmul={flops / best['native'] / mm:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
