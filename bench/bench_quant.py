"""``--quantization fp8`` against the checkpoint's bf16 weights at real size: load time,
prefill, decode at batch 1 and 16, and the bytes a batch-1 step reads, each side in fresh
processes alternated over rounds (this machine's read bandwidth moves within minutes: only
ratios of neighbouring runs mean anything), with a bandwidth reading before each decode run.

Per side it prints the medians, then fp8 over bf16. Also how far fp8 moves the logits of one
prompt from bf16's (random weights: a measure of the rounding, not of a task's accuracy).

    HF_HUB_OFFLINE=1 python bench/bench_quant.py --preset qwen3_5_0_8b --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))

from bench_real import MORE_PRESETS, PRESETS, checkpoint  # noqa: E402

SIDE_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[4])
from mambaradix.engine.engine import Engine
from bench_real import engine_decode, engine_prefill, read_bandwidth, weight_figures
eng = Engine(model_path=sys.argv[1], num_threads=int(sys.argv[2]), dtype="bfloat16",
             quantization=sys.argv[3], disable_radix_cache=True)
ready = time.perf_counter() - t0
vocab = eng.model.vocab_size
read_bytes = weight_figures(eng.model)[0]
out = dict(start=ready, read_bytes=read_bytes, prefill_2048=engine_prefill(eng, 2048, vocab, 2))
out["b1"] = max(engine_decode(eng, 1, vocab, 64, s) for s in range(2))
out["b16"] = max(engine_decode(eng, 16, vocab, 16, s) for s in range(2))
from mambaradix.core import SamplingParams
ids = [(i * 7919) % (vocab - 10) + 5 for i in range(256)]
p = SamplingParams(temperature=0.0, max_new_tokens=1, return_logprob=True, top_logprobs=20)
(handle,) = eng.submit_many([ids], [p])
tops = [t for ev in handle.events() for t in ev.new_top_logprobs or []]
out["top20"] = [list(tops[0][0]), list(tops[0][1])]  # ids, logprobs
eng.shutdown()
print(json.dumps(out))
"""

BANDWIDTH_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from bench_real import read_bandwidth
print(json.dumps(read_bandwidth(int(sys.argv[1]))))
"""


def fresh(script: str, *args: str) -> object:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    if out.returncode:
        sys.exit(f"a side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="qwen3_5_0_8b", choices=[*PRESETS, *MORE_PRESETS])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    folder, here = str(checkpoint(args.preset)), str(Path(__file__).parent)
    runs: dict[str, list[dict]] = {"bf16": [], "fp8": []}
    sides = [("bf16", ""), ("fp8", "fp8")]
    for r in tqdm(range(args.rounds), desc="rounds"):
        for name, quant in sides if r % 2 == 0 else sides[::-1]:
            bw = fresh(BANDWIDTH_SCRIPT, str(args.threads), here)
            run = fresh(SIDE_SCRIPT, folder, str(args.threads), quant, here)
            run["of_limit"] = run["b1"] * run["read_bytes"] / bw
            runs[name].append(run)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in
               ("start", "read_bytes", "prefill_2048", "b1", "b16", "of_limit")}
           for n, rs in runs.items()}  # fmt: skip
    print(f"preset {args.preset}, {args.rounds} alternated rounds, {args.threads} threads")
    print(f"{'':<6} {'start s':>8} {'GB/step':>8} {'prefill 2k':>11} {'b1 tok/s':>9} "
          f"{'b16 tok/s':>9} {'b1 of limit':>11}")  # fmt: skip
    for n, m in med.items():
        print(f"{n:<6} {m['start']:8.2f} {m['read_bytes'] / 1e9:8.3f} {m['prefill_2048']:11.1f} "
              f"{m['b1']:9.2f} {m['b16']:9.1f} {m['of_limit']:11.2f}")  # fmt: skip
    pairs = [(a["b1"] / b["b1"], a["b16"] / b["b16"], a["prefill_2048"] / b["prefill_2048"])
             for a, b in zip(runs["fp8"], runs["bf16"])]  # fmt: skip
    print("fp8 / bf16 per round: b1 " + " ".join(f"{p[0]:.2f}" for p in pairs)
          + ", b16 " + " ".join(f"{p[1]:.2f}" for p in pairs)
          + ", prefill " + " ".join(f"{p[2]:.2f}" for p in pairs))  # fmt: skip
    ref, got = runs["bf16"][0]["top20"], runs["fp8"][0]["top20"]
    ref_lp, got_lp = dict(zip(*ref)), dict(zip(*got))
    common = [t for t in ref_lp if t in got_lp]
    diff = max(abs(ref_lp[t] - got_lp[t]) for t in common)
    print(
        f"next-token top-20 after a 256-token prompt: {len(common)} / 20 tokens shared, "
        f"top-1 {'same' if ref[0][0] == got[0][0] else 'differs'}, "
        f"largest logprob difference {diff:.3f}"
    )


if __name__ == "__main__":
    main()
