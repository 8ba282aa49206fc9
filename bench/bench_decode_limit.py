"""Batch-1 decode against the machine's read bandwidth, in one engine process.

Two figures for a real-size preset (``bench_real.py`` builds the checkpoints):

- **pairs**: the read bandwidth (``torch.sum`` over a 1 GiB fp32 tensor, best of 5) measured on
  the runner's own thread and OpenMP pool, then a batch-1 decode through the ``Engine``; each
  pair gives decode tok/s over the limit (bandwidth / weight bytes a step reads, as in
  ``bench_real.py``). Reading on any other thread would start a second OpenMP pool and slow the
  engine (``engine/cpu_runtime.py``).
- **linear loop**: the native bf16 linear over every weight matrix of the model, one row, one
  call after another (what the decode step's weight reads cost with nothing between them), on
  the runner's thread too, alternated with ``torch.sum`` over fp32 copies of the same matrices
  and over one tensor of the same bytes: the GB/s of each, median of the rounds.

The gap between the two tells what of a step is not weight streaming.

    HF_HUB_OFFLINE=1 python bench/bench_decode_limit.py --preset lfm2_350m
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from bench_real import (  # noqa: E402
    PRESETS,
    decode_engine,
    engine_decode,
    read_bandwidth,
    weight_figures,
)


def pairs(eng, threads: int, n: int, steps: int) -> list[tuple[float, float]]:
    """(read bytes/s, decode tok/s) ``n`` times, the reading on the runner's thread."""
    out = []
    for s in tqdm(range(n), desc="pairs", leave=False):
        bw = eng.runner.on_thread(read_bandwidth, threads).result()
        out.append((bw, engine_decode(eng, 1, eng.model.vocab_size, steps, s)))
    return out


def linear_loop(model: torch.nn.Module, rounds: int) -> dict[str, list[float]]:
    from mambaradix.kernels import native

    lib = native.load("linear")
    if lib is None:
        raise SystemExit("the native linear kernel did not build: nothing to measure")
    ws = [p.detach().contiguous() for n, p in model.named_parameters()
          if p.dim() == 2 and p.dtype is torch.bfloat16 and "embed" not in n]  # fmt: skip
    if not any(w.data_ptr() == model.lm_head.weight.data_ptr() for w in ws):
        ws.append(model.lm_head.weight.detach())  # tied to the embedding
    total = sum(w.numel() * 2 for w in ws)
    outs = [torch.empty(1, w.shape[0], dtype=torch.bfloat16) for w in ws]
    xs = {w.shape[1]: torch.randn(1, w.shape[1]).to(torch.bfloat16) for w in ws}
    fp32 = [w.float() for w in ws]
    one = torch.ones(total // 4)

    def linear() -> None:
        for w, o in zip(ws, outs):
            x = xs[w.shape[1]]
            lib.linear_bf16(1, w.shape[0], w.shape[1], x.data_ptr(), x.stride(0), w.data_ptr(),
                            None, o.data_ptr())  # fmt: skip

    runs = {
        "native linear, bf16 matrices": (linear, total),
        "torch.sum, fp32 copies of the matrices": (lambda: [w.sum() for w in fp32], 2 * total),
        "torch.sum, one fp32 tensor": (lambda: one.sum(), total),
    }
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for _ in tqdm(range(rounds), desc="linear loop", leave=False):
        for name, (fn, nbytes) in runs.items():
            t = time.perf_counter()
            fn()
            rates[name].append(nbytes / (time.perf_counter() - t))
    print(f"linear loop: {len(ws)} matrices, {total / 1e9:.3f} GB of bf16 weights")
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="lfm2_350m", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64, help="decode steps of each pair")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the linear loop")
    args = ap.parse_args()

    eng = decode_engine(args.preset, args.threads)
    read_bytes, *_ = weight_figures(eng.model)
    ratios = []
    for bw, tok_s in pairs(eng, args.threads, args.pairs, args.steps):
        ratios.append(tok_s * read_bytes / bw)
        print(f"read {bw / 1e9:5.1f} GB/s  limit {bw / read_bytes:6.2f} tok/s  "
              f"decode b1 {tok_s:6.2f} tok/s  of limit {ratios[-1]:.3f}")  # fmt: skip
    print(
        f"decode b1 of limit: median {statistics.median(ratios):.3f}, "
        f"{min(ratios):.3f}-{max(ratios):.3f} ({read_bytes / 1e9:.3f} GB read a step)"
    )
    rates = eng.runner.on_thread(linear_loop, eng.model, args.rounds).result()
    eng.shutdown()
    ref = statistics.median(rates["torch.sum, one fp32 tensor"])
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"{name:40s} {med / 1e9:6.1f} GB/s median ({min(r) / 1e9:.1f}-{max(r) / 1e9:.1f}), "
              f"{med / ref:.2f} of the one-tensor read")  # fmt: skip


if __name__ == "__main__":
    main()
