"""bf16 against fp32 compute of a bf16 checkpoint on this CPU: what ``--dtype auto`` should
pick here, and what it picks.

Per preset (bench_real's real-size checkpoints), fresh processes alternating the two dtypes,
``--rounds`` of each, cache off, the default kernel backend: start (engine construction, the
warm-up included), prefill tok/s of a 512- and a 2,048-token prompt, decode tok/s at batch 1
and 16 (bench_real's measures: from the outputs' arrival times once every request decodes),
and the process's peak resident memory. Then the medians, bf16 / fp32, and the dtype
``--dtype auto`` takes on this machine with this backend.

    python bench/bench_dtype.py                             # two presets, one round
    python bench/bench_dtype.py --presets qwen3_5_0_8b --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FIELDS = ("start_s", "prefill_512", "prefill_2048", "decode_b1", "decode_b16", "peak_rss_gb")


def measure(preset: str, dtype: str, threads: int) -> dict[str, float]:
    """One side in this process (a fresh one: an engine's OpenMP pool outlives it)."""
    import bench_real

    from mambaradix.engine.engine import Engine

    folder = bench_real.checkpoint(preset)
    t0 = time.perf_counter()
    eng = Engine(model_path=str(folder), num_threads=threads, disable_radix_cache=True,
                 dtype=dtype)  # fmt: skip
    start = time.perf_counter() - t0
    vocab = eng.model.vocab_size
    out = dict(
        start_s=start,
        prefill_512=bench_real.engine_prefill(eng, 512, vocab, 2),
        prefill_2048=bench_real.engine_prefill(eng, 2048, vocab, 1),
        decode_b1=max(bench_real.engine_decode(eng, 1, vocab, 48, s) for s in range(2)),
        decode_b16=bench_real.engine_decode(eng, 16, vocab, 12, 0),
    )
    eng.shutdown()
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB -> GB
    return out


def auto_choice() -> str:
    """The dtype ``--dtype auto`` gives a bf16 checkpoint here with the default backend."""
    from mambaradix.kernels.backend import choose_backend

    return "bfloat16" if choose_backend("auto", "cpu").fast_bf16_on_cpu() else "float32"


def main() -> None:
    import bench_real

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=["qwen3_5_0_8b", "granite_4_0_h_350m"],
                    choices=list(bench_real.PRESETS))  # fmt: skip
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--part", nargs=2, metavar=("PRESET", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        print(json.dumps(measure(*args.part, args.threads)))
        return
    from tqdm import tqdm

    print(f"# bench_dtype threads={args.threads} --dtype auto here: {auto_choice()}")
    sides = ("bfloat16", "float32")
    runs = [(p, d) for p in args.presets for _ in range(args.rounds) for d in sides]
    got: dict[tuple[str, str], list[dict[str, float]]] = {}
    for preset, dtype in tqdm(runs, desc="fresh processes"):
        bench_real.checkpoint(preset)  # built once, outside the timed process
        cmd = [sys.executable, __file__, "--threads", str(args.threads), "--part", preset, dtype]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        one = json.loads(out.stdout.strip().splitlines()[-1])
        got.setdefault((preset, dtype), []).append(one)
        tqdm.write(f"{preset} {dtype}: " + " ".join(f"{k}={v:.2f}" for k, v in one.items()))
    print("| preset | figure | bf16 | fp32 | bf16 / fp32 |")
    print("|---|---|---|---|---|")
    for preset in args.presets:
        for f in FIELDS:
            b, s = (statistics.median(r[f] for r in got[(preset, d)]) for d in sides)
            print(f"| {preset} | {f} | {b:.2f} | {s:.2f} | {b / s:.2f}x |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
