"""A mixture of experts' routed part on the ``cpu`` backend, one layer at a published shape:
ms per layer (the mean over ``--layers`` layers of distinct weights, so no layer's weights are
still cached from the run before; the best of ``--reps``) of the torch reference
(``kernels/moe.py``: a padded batched GEMM over every expert for decode batches, one GEMM pair
per expert with tokens for larger ones) and of the backend's ``moe_experts`` (for bf16 decode
batches one C call that reads only the routed experts' weights, ``moe_gated_bf16``; other batches
the reference), alternated; and the GB/s at which the backend read the routed experts' weights.
Random routing (each token's ``k`` experts drawn without repeats), bf16 (``--dtype``).

    python bench/bench_moe.py --shape granite_4_0_h_tiny --batches 1 4 16 64 512 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend

# experts, top-k, intermediate, hidden (models/published_configs.py)
SHAPES = {
    "granite_4_0_h_tiny": (64, 6, 512, 1536),
    "qwen3_5_35b_a3b": (256, 8, 512, 2048),
    "qwen3_next_80b_a3b": (512, 10, 512, 2048),
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
    E, K, inter, hidden = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    layers = [
        (
            (torch.randn(E, 2 * inter, hidden, generator=g) * 0.02).to(dtype),
            (torch.randn(E, hidden, inter, generator=g) * 0.02).to(dtype),
        )
        for _ in range(args.layers)
    ]
    be = CpuBackend()
    sides = {
        "reference": lambda *a: TorchBackend.moe_experts(be, *a),
        "backend": be.moe_experts,
    }
    print(f"# {args.shape}: {E} experts, top {K}, intermediate {inter}, hidden {hidden}, {dtype}, "
          f"{args.threads} threads; ms a layer")  # fmt: skip
    for T in args.batches:
        x = torch.randn(T, hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.softmax(torch.randn(T, K, generator=g), -1).to(dtype)
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.reps):
            for name, fn in sides.items():
                t0 = time.perf_counter()
                for gate_up, down in layers:
                    fn(x, w, ids, gate_up, down, "silu")
                best[name] = min(best[name], (time.perf_counter() - t0) / len(layers))
        routed = len(set(ids.flatten().tolist())) * 3 * inter * hidden * dtype.itemsize
        print(f"batch {T:5d}: reference {best['reference'] * 1e3:8.2f}  backend "
              f"{best['backend'] * 1e3:8.2f}  ({best['reference'] / best['backend']:.2f}x; "
              f"{routed / best['backend'] / 1e9:.1f} GB/s of the routed weights)")  # fmt: skip


if __name__ == "__main__":
    main()
