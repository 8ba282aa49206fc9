"""A mixture of experts' routed part on the ``cpu`` backend, one layer at a published shape:
ms per layer (the mean over ``--layers`` layers of distinct weights, so no layer's weights are
still cached from the run before; the best of ``--reps``) of the torch reference
(``kernels/moe.py``: a padded batched GEMM over every expert for decode batches, one GEMM pair
per expert with tokens for larger ones) and of the backend's ``moe_experts`` (for bf16 decode
batches one C call that reads only the routed experts' weights, ``moe_experts_bf16``; other batches
the reference), alternated; and the GB/s at which the backend read the routed experts' weights.
Random routing (each token's ``k`` experts drawn without repeats), bf16 (``--dtype``). A third
side, ``loop``, is the reference's per-expert loop (one GEMM pair per routed expert: what
Nemotron-H's MoE block ran before its experts moved onto the op). Nemotron-3-Nano's experts are
plain (``relu2(up)``, fp32 routing weights, as its router gives them).

    python bench/bench_moe.py --shape granite_4_0_h_tiny --batches 1 4 16 64 512 --threads 2
    python bench/bench_moe.py --shape nemotron_3_nano_30b_a3b --layers 3 --batches 1 4 16
"""

from __future__ import annotations

import argparse
import time

import torch

from mambaradix.kernels import moe
from mambaradix.kernels.activation import activation
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend

# experts, top-k, intermediate, hidden, gated (models/published_configs.py)
SHAPES = {
    "granite_4_0_h_tiny": (64, 6, 512, 1536, True),
    "qwen3_5_35b_a3b": (256, 8, 512, 2048, True),
    "qwen3_next_80b_a3b": (512, 10, 512, 2048, True),
    "nemotron_3_nano_30b_a3b": (128, 6, 1856, 2688, False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="granite_4_0_h_tiny", choices=list(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--layers", type=int, default=8, help="layers of distinct weights")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    E, K, inter, hidden, gated = SHAPES[args.shape]
    act = "silu" if gated else "relu2"
    g = torch.Generator().manual_seed(0)
    layers = [
        (
            (torch.randn(E, (2 if gated else 1) * inter, hidden, generator=g) * 0.02).to(dtype),
            (torch.randn(E, hidden, inter, generator=g) * 0.02).to(dtype),
        )
        for _ in range(args.layers)
    ]
    be = CpuBackend()
    sides = {
        "reference": lambda *a: TorchBackend.moe_experts(be, *a, gated),
        "loop": lambda *a: moe.moe_experts(be, *a[:-1], activation(act), E, gated),
        "backend": lambda *a: be.moe_experts(*a, gated),
    }
    print(f"# {args.shape}: {E} experts ({'gated' if gated else 'plain'}), top {K}, intermediate "
          f"{inter}, hidden {hidden}, {dtype}, {args.threads} threads; ms a layer")  # fmt: skip
    for T in args.batches:
        x = torch.randn(T, hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.softmax(torch.randn(T, K, generator=g), -1)
        w = w if not gated else w.to(dtype)  # (Nemotron-H's router: fp32 weights)
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.reps):
            for name, fn in sides.items():
                t0 = time.perf_counter()
                for gate_up, down in layers:
                    fn(x, w, ids, gate_up, down, act)
                best[name] = min(best[name], (time.perf_counter() - t0) / len(layers))
        mats = 3 if gated else 2
        routed = len(set(ids.flatten().tolist())) * mats * inter * hidden * dtype.itemsize
        ms = {name: t * 1e3 for name, t in best.items()}
        print(f"batch {T:5d}: reference {ms['reference']:8.2f}  loop {ms['loop']:8.2f}  backend "
              f"{ms['backend']:8.2f}  ({ms['reference'] / ms['backend']:.2f}x, "
              f"{ms['loop'] / ms['backend']:.2f}x; "
              f"{routed / best['backend'] / 1e9:.1f} GB/s of the routed weights)")  # fmt: skip


if __name__ == "__main__":
    main()
