"""One Gated DeltaNet layer's prefill on the ``cpu`` backend (the native chunk-free scan,
``kernels/csrc/gated_delta_scan.c``): ms per call of one segment of ``--tokens`` tokens, the
best of ``--reps``, with inputs laid out as the prefill conv leaves them (channel-major views
of one buffer). Defaults: Qwen3.5-0.8B's layer (16 key and value heads of 128 x 128), bf16.
To compare two commits, run it from each tree in turn (``PYTHONPATH=<tree>/src``), alternating.

    python bench/bench_gdn_prefill.py --tokens 512 2048 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from mambaradix.core import ForwardReq
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.gated_delta import gdn_gates
from mambaradix.layout import ForwardLayout


def layer_inputs(T: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    conv_out = torch.randn(2 * hk * dk + hv * dv, T, generator=g).to(dtype).t()
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    a, b = (torch.randn(T, hv, generator=g).to(dtype) for _ in range(2))
    gate, beta = gdn_gates(a, b, torch.rand(hv, generator=g), torch.randn(hv, generator=g))
    inputs = (q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv), gate, beta)
    pool = torch.randn(2, hv, dk, dv, generator=g) * 0.1
    layout = ForwardLayout.build([ForwardReq(0, list(range(T)), torch.arange(T), 1)])
    return layout, inputs, pool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 16], metavar=("HK", "HV"))
    ap.add_argument("--dims", type=int, nargs=2, default=[128, 128], metavar=("DK", "DV"))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backend = CpuBackend()
    for T in args.tokens:
        layout, inputs, pool = layer_inputs(T, *args.heads, *args.dims, getattr(torch, args.dtype))
        backend.prepare(layout)
        best = float("inf")
        for _ in range(args.reps):
            p = pool.clone()
            t0 = time.perf_counter()
            backend.gdn_prefill(*inputs, p, layout)
            best = min(best, time.perf_counter() - t0)
        print(f"gdn_prefill T={T}: {best * 1e3:.2f} ms ({T / best:.0f} tok/s a layer)")


if __name__ == "__main__":
    main()
