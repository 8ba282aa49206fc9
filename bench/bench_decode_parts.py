"""What a decode step is made of (batch 1 by default, ``--batch``), in one engine process: the
linears (weight streaming at batch 1, arithmetic at tens of rows) and everything else.

Three figures, alternated over rounds, all on the runner's thread (``ModelRunner.on_thread``):

- **forward**: the model's decode forward over the whole batch, timed inside the runner (median
  over a decode run);
- **without the linears**: the same forward with every linear and gated MLP of the batch's rows
  answered by a preallocated output (no weight is read): the recurrent steps, norms,
  attention, sampling's share and Python;
- **linears alone**: the linear and gated-MLP calls of one such step, captured with their
  inputs, replayed in the model's order;
- **native calls alone**: every C kernel call of that step (linears, recurrent steps, norms,
  attention, sampling), captured at the ctypes boundary with every tensor of the step kept
  alive, replayed with the same arguments: the step without Python between the kernels. The
  replays run the state kernels again on the captured slots (timing only: the benchmark's
  outputs are not used);
- **replayed step**: the engine's own decode step graph (``engine.step_graph``: the recorded
  step replayed with each step's inputs written in), timed inside the runner as the forward
  is. The first three figures run with the graphs off (the Python forward).

If the two parts add up to the forward, the linears run among the other ops as fast as alone.

Then what bounds the step: the read bandwidth (``torch.sum`` over 1 GiB, best of 5, on the
runner's thread, alternated with the rounds), the weight bytes a step reads (as the limit of
``bench_real.py`` counts them) and the recurrent-state bytes it reads and writes (every
decode's conv and temporal state, once each way): their times at that bandwidth, the ceiling
of decode tok/s over the weight-only limit that the state traffic leaves, and the rest of the
forward (norms, attention, Python and the kernel calls' fixed costs).

    HF_HUB_OFFLINE=1 python bench/bench_decode_parts.py --preset lfm2_350m [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from bench_real import (  # noqa: E402
    MORE_PRESETS,
    PRESETS,
    decode_engine,
    engine_decode,
    read_bandwidth,
    weight_figures,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="lfm2_350m", choices=sorted([*PRESETS, *MORE_PRESETS]))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="decode steps of each timed run")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = ap.parse_args()
    rows = args.batch  # (under 128: prompts are 128 tokens, so no prefill has this many rows)

    from mambaradix.kernels import native

    eng = decode_engine(args.preset, args.threads)
    backend, model = eng.runner.backend, eng.model
    graphs = eng.runner.graphs  # off for the Python forward's figures
    eng.runner.graphs = None
    linear, gated_mlp, forward = backend.linear, backend.gated_mlp, model.forward
    outputs: dict[tuple[int, int], torch.Tensor] = {}

    def no_weights(rows: int, n: int) -> torch.Tensor:
        return outputs.setdefault((rows, n), torch.zeros(rows, n, dtype=torch.bfloat16))

    def fake_linear(x, w, b):
        return linear(x, w, b) if x.shape[0] != rows else no_weights(rows, w.shape[0])

    def fake_mlp(x, gu, down, act):
        if x.shape[0] != rows:
            return gated_mlp(x, gu, down, act)
        return no_weights(rows, down.shape[0])

    times: list[float] = []
    capture = {"on": False, "done": False}  # the first whole-batch decode step is captured
    native_calls: list[tuple] = []
    kept: list = []  # every tensor of the captured step, so its pointers stay valid

    class KeepTensors(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            kept.append(out)
            return out

    def timed_graph(ctx):
        whole = ctx.layout.prefill is None and len(ctx.layout.reqs) == rows
        t = time.perf_counter()
        out = graph_forward(ctx)
        if whole and out is not None:
            times.append(time.perf_counter() - t)
        return out

    if graphs is not None:
        graph_forward = graphs.forward
        graphs.forward = timed_graph

    def timed_forward(ctx):
        whole = ctx.layout.prefill is None and len(ctx.layout.reqs) == rows
        capture["on"] = whole and not capture["done"]
        t = time.perf_counter()
        if capture["on"]:
            with native.recording() as recorded, KeepTensors():
                out = forward(ctx)
            native_calls.extend((c.function, c.args) for c in recorded)
            kept.append(ctx)
        else:
            out = forward(ctx)
        if whole:
            times.append(time.perf_counter() - t)
        capture["done"] |= capture["on"]
        capture["on"] = False
        return out

    model.forward = timed_forward
    calls: list[tuple] = []

    def capture_linear(x, w, b):
        if capture["on"] and x.shape[0] == rows:
            calls.append((linear, x.clone(), w, b))
        return linear(x, w, b)

    def capture_mlp(x, gu, down, act):
        if capture["on"] and x.shape[0] == rows:
            calls.append((gated_mlp, x.clone(), gu, down, act))
        return gated_mlp(x, gu, down, act)

    backend.linear, backend.gated_mlp = capture_linear, capture_mlp
    engine_decode(eng, rows, model.vocab_size, 4, 0)  # prefills, then decode steps
    step = list(calls)
    assert step, "no decode step of the whole batch was seen"

    def replay() -> float:
        t = time.perf_counter()
        for fn, *a in step:
            fn(*a)
        return time.perf_counter() - t

    def replay_native() -> float:
        t = time.perf_counter()
        for fn, a in native_calls:
            fn(*a)
        return time.perf_counter() - t

    figures: dict[str, list[float]] = {"forward": [], "without the linears": [],
                                       "linears alone": [], "native calls alone": [],
                                       "replayed step": []}  # fmt: skip
    bandwidth: list[float] = []
    for r in tqdm(range(args.rounds), desc="rounds", leave=False):
        bandwidth.append(eng.runner.on_thread(read_bandwidth, args.threads).result())
        for name, ops in (("forward", (linear, gated_mlp)),
                          ("without the linears", (fake_linear, fake_mlp))):  # fmt: skip
            backend.linear, backend.gated_mlp = ops
            times.clear()
            engine_decode(eng, rows, model.vocab_size, args.steps, r + 2)
            figures[name].append(statistics.median(times))
        backend.linear, backend.gated_mlp = linear, gated_mlp
        runs = eng.runner.on_thread(lambda: [replay() for _ in range(5)]).result()
        figures["linears alone"].append(statistics.median(runs))
        runs = eng.runner.on_thread(lambda: [replay_native() for _ in range(5)]).result()
        figures["native calls alone"].append(statistics.median(runs))
        if graphs is not None:
            eng.runner.graphs = graphs
            times.clear()
            engine_decode(eng, rows, model.vocab_size, args.steps, r + 2)
            eng.runner.graphs = None
            if times:  # (none when the step cannot be replayed: the engine logged why)
                figures["replayed step"].append(statistics.median(times))
    eng.shutdown()
    print(f"{args.preset}, batch {rows}: {len(step)} linear / gated-MLP calls and "
          f"{len(native_calls)} native calls in all a decode step")  # fmt: skip
    for name, v in figures.items():
        if not v:
            continue
        print(f"{name:22s} {statistics.median(v) * 1e3:7.2f} ms median "
              f"({', '.join(f'{x * 1e3:.1f}' for x in v)})")  # fmt: skip
    parts = statistics.median(figures["without the linears"]) + statistics.median(
        figures["linears alone"]
    )
    forward = statistics.median(figures["forward"])
    print(f"parts / forward: {parts / forward:.2f}")
    alone = statistics.median(figures["native calls alone"])
    print(f"native calls alone / forward: {alone / forward:.2f}")
    if figures["replayed step"]:
        replayed = statistics.median(figures["replayed step"])
        print(f"replayed step / forward: {replayed / forward:.2f}")
    bw = statistics.median(bandwidth)
    weights, *_ = weight_figures(model)
    state = 2 * rows * eng.runner.state_pool.slot_bytes  # read and written once a step
    each = ", ".join(f"{b / 1e9:.1f}" for b in bandwidth)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s median ({each})")
    print(f"weights  {weights / 1e9:.3f} GB a step: {weights / bw * 1e3:6.2f} ms at that bandwidth")
    print(
        f"states   {state / 1e6:.1f} MB read + written: {state / bw * 1e3:6.2f} ms; ceiling of "
        f"decode over the weight-only limit: {weights / (weights + state):.3f}"
    )
    rest = forward - (weights + state) / bw
    print(
        f"rest of the forward {rest * 1e3:.2f} ms ({rest / forward:.0%}); forward over the "
        f"weight-only limit: {weights / bw / forward:.3f}"
    )


if __name__ == "__main__":
    main()
