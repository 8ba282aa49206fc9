"""Cost of structured output per decode step in the engine (A/B in one process).

Runs the same batch of ``--batch`` requests (same prompts, ``--tokens`` output tokens each,
greedy) with and without a JSON-schema grammar, alternating the two arms ``--repeats`` times
on one engine, and prints the median wall time per decode step of each arm and their ratio.
The schema's output is longer than ``--tokens`` (an array of long strings), so every request
runs to the limit in both arms and both do the same number of steps.

    python bench/bench_structured.py                          # tiny:qwen3_next, batch 16
    python bench/bench_structured.py --model tiny:qwen3_next:small --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from mambaradix.core import GrammarSpec, SamplingParams
from mambaradix.engine.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "minLength": 8, "maxLength": 24},
            "minItems": 40,
            "maxItems": 40,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def run_arm(eng: Engine, prompts: list[list[int]], tokens: int, grammar) -> float:
    """Seconds per decode step of one batch (prefill excluded: timed from the first token)."""
    params = [
        SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
        for _ in prompts
    ]
    handles = eng.submit_many(prompts, params)
    first = None
    for out in handles[0].events():
        if first is None and out.new_token_ids:
            first = time.perf_counter()
    for h in handles[1:]:
        h.result()
    end = time.perf_counter()
    return (end - first) / max(1, tokens - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:qwen3_next")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = Engine(model_path=args.model, disable_radix_cache=True, num_threads=args.threads)
    try:
        tok = eng.tokenizer
        prompts = [tok.encode(f"Request {i}: list forty words.") for i in range(args.batch)]
        grammar = GrammarSpec.from_json_schema(SCHEMA)
        eng.structured.compiler.compile(grammar)  # compiled once, outside the timing
        run_arm(eng, prompts, 8, grammar)  # warm both paths
        run_arm(eng, prompts, 8, None)
        arms: dict[str, list[float]] = {"plain": [], "json_schema": [], "json_schema inline": []}
        for _ in range(args.repeats):
            arms["plain"].append(run_arm(eng, prompts, args.tokens, None))
            eng.structured.fill_during_forward = True
            arms["json_schema"].append(run_arm(eng, prompts, args.tokens, grammar))
            eng.structured.fill_during_forward = False
            arms["json_schema inline"].append(run_arm(eng, prompts, args.tokens, grammar))
        print(
            f"{args.model} vocab={eng.model.vocab_size} batch={args.batch} "
            f"tokens={args.tokens} repeats={args.repeats} threads={args.threads}; ms per "
            "decode step (json_schema: masks filled on a thread during the forward; inline: "
            "before it, on the runner thread)"
        )
        base_min, base_med = min(arms["plain"]), statistics.median(arms["plain"])
        for name, runs in arms.items():
            lo, med = min(runs), statistics.median(runs)
            print(
                f"{name:<20} min {lo * 1e3:7.2f} ({lo / base_min:5.3f} of plain)  median "
                f"{med * 1e3:7.2f} ({med / base_med:5.3f})  runs: "
                + ", ".join(f"{x * 1e3:.1f}" for x in runs)
            )
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
