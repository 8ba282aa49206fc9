"""The short causal conv of a prefill on the ``cpu`` backend (``kernels/csrc/conv_prefill.c``):
ms per call of one segment of ``--tokens`` tokens, the best of ``--reps``, for each model's
layer shape (``--shapes``): Qwen3.5-0.8B's Gated DeltaNet q|k|v (6,144 channels, width 4,
SiLU), Granite-4.0-H-350M's Mamba2 xBC (2,048, width 4, bias, SiLU), LFM2-350M's short conv
(1,024, width 3, no activation); bf16, the input a row-strided view (as the in-projection's
output leaves it), two snapshots in the segment. To compare two commits, run it from each tree
in turn (``PYTHONPATH=<tree>/src``), alternating.

    python bench/bench_conv_prefill.py --tokens 512 2048 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from mambaradix.core import ForwardReq
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.layout import ForwardLayout

# channels, width, bias, activation
SHAPES = {
    "qwen3_5_0_8b": (6144, 4, False, "silu"),
    "granite_4_0_h_350m": (2048, 4, True, "silu"),
    "lfm2_350m": (1024, 3, False, None),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend = CpuBackend()
    g = torch.Generator().manual_seed(0)
    for name in args.shapes:
        C, K, bias, act = SHAPES[name]
        w = torch.randn(C, K, generator=g).bfloat16()
        b = torch.randn(C, generator=g).bfloat16() if bias else None
        pool = torch.randn(4, C, K - 1, generator=g).bfloat16()
        for T in args.tokens:
            x = torch.randn(T, 2 * C, generator=g).bfloat16()[:, :C]
            req = ForwardReq(
                0, list(range(T)), torch.arange(T), 1, snapshots=[(T // 4, 2), (T // 2, 3)]
            )
            layout = ForwardLayout.build([req])
            backend.prepare(layout)
            best = float("inf")
            for _ in range(args.reps):
                p = pool.clone()
                t0 = time.perf_counter()
                backend.conv1d_prefill(x, w, b, p, layout, act)
                best = min(best, time.perf_counter() - t0)
            print(f"conv1d_prefill {name} T={T}: {best * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
