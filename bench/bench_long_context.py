"""Long contexts at real size: prefill, a chat or agent turn after a long cached history, and
decode over a long context.

On a real-size preset (bench_real's checkpoints: random bf16 weights, ``--threads`` threads),
one engine (cache on, ``--context-length`` 40k), for each context length L of ``--lengths``:

- prefill tok/s of a cold L-token prompt (no hit; chunked at the CPU's 512 tokens, so every
  chunk after the first attends the prompt's earlier chunks as a cached prefix does);
- a turn: the L-token history is sent once (cached), then the history + ``--turn`` new tokens:
  the seconds of that request (one output token), i.e. the time to first token of a turn;
- decode tok/s at batch 1 after an L-token prompt, and after a 128-token one (the same run)
  for the ratio: what reading L keys costs a step (the prompt cached, then sent for one token
  and for ``--decode-steps`` + 1: the difference of the two is the steps alone).

``--compare reference`` runs the prefill and turn figures also with prefill attention on the
torch reference (ATen's flash kernel with its cascades: what ran before the native kernel,
``csrc/attention_prefill.c``), ``--compare one_call`` also with the reference and a long
prefix attended as one masked call (before the cascades, fb4c748); the modes alternate,
``--rounds`` rounds each, every figure the best of its rounds.

    HF_HUB_OFFLINE=1 python bench/bench_long_context.py [--preset qwen3_5_0_8b]
        [--lengths 2048 8192 16384] [--turn 512] [--compare reference one_call] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import PRESETS, checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3_5_0_8b", choices=sorted(PRESETS))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--turn", type=int, default=512, help="new tokens of a turn")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compare", nargs="*", default=[], choices=["reference", "one_call"])
    args = ap.parse_args()

    from tqdm import tqdm

    from mambaradix.engine.engine import Engine
    from mambaradix.kernels import attention, cpu

    eng = Engine(
        model_path=str(checkpoint(args.preset)),
        num_threads=args.threads,
        context_length=max(args.lengths) + args.turn + args.decode_steps + 64,
    )
    vocab = eng.model.vocab_size
    seed = iter(range(1, 1 << 30))

    def prompt(n: int) -> list[int]:  # a new prompt each call: no hit unless meant
        k = next(seed)
        return [(i * 7919 + k * 104729) % (vocab - 10) + 5 for i in range(n)]

    def seconds(ids: list[int], new: int = 1) -> float:
        p = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        t = time.perf_counter()
        eng.generate(input_ids=ids, sampling_params=p)
        return time.perf_counter() - t

    seconds(prompt(512))  # warm-up: kernel builds, first-call costs
    cascade = attention.LONG_PREFIX
    # mode -> (native prefill attention, LONG_PREFIX of the reference)
    modes = {"native": (True, cascade)}
    modes |= {"reference": (False, cascade), "one_call": (False, 1 << 40)}
    modes = {m: v for m, v in modes.items() if m == "native" or m in args.compare}
    best: dict[tuple[str, str, int], float] = {}
    bar = tqdm(total=args.rounds * len(modes) * len(args.lengths), leave=False)
    for r in range(args.rounds):
        order = list(modes.items()) if r % 2 == 0 else list(reversed(modes.items()))
        for name, (native, long_prefix) in order:
            cpu.NATIVE_PREFILL_ATTENTION, attention.LONG_PREFIX = native, long_prefix
            for n in args.lengths:
                tok_s = n / seconds(prompt(n))
                history = prompt(n)
                seconds(history)
                turn = seconds(history + prompt(args.turn))
                best[name, "prefill_tok_s", n] = max(best.get((name, "prefill_tok_s", n), 0), tok_s)
                best[name, "turn_s", n] = min(best.get((name, "turn_s", n), turn), turn)
                bar.update()
    cpu.NATIVE_PREFILL_ATTENTION, attention.LONG_PREFIX = True, cascade
    bar.close()

    def decode_tok_s(n: int) -> float:
        # the prompt cached first; then the same prompt for one token and for steps + 1: both
        # resume from the same cached state, so the difference is the decode steps alone
        ids = prompt(n)
        seconds(ids)
        one, many = seconds(ids), seconds(ids, args.decode_steps + 1)
        return args.decode_steps / max(many - one, 1e-9)

    for n in args.lengths:
        row = {
            f"{m}_{what}": best[m, what, n] for m in modes for what in ("prefill_tok_s", "turn_s")
        }
        for m in modes:
            if m != "native":
                row[f"turn_speedup_over_{m}"] = row[f"{m}_turn_s"] / row["native_turn_s"]
                row[f"prefill_speedup_over_{m}"] = (
                    row["native_prefill_tok_s"] / row[f"{m}_prefill_tok_s"]
                )
        short, long = decode_tok_s(128), decode_tok_s(n)
        row |= {"decode_b1_tok_s": long, "decode_b1_over_128_context": long / short}
        body = " ".join(
            f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
        )
        print(f"preset={args.preset} context={n} turn={args.turn} {body}", flush=True)


if __name__ == "__main__":
    main()
