"""Speculative decoding at real size: what a verify step costs and what it yields.

On the real-size Qwen3.5-0.8B-shaped preset (bench_real's checkpoint: random bf16 weights,
bf16, ``--threads`` threads), batch 1 at a 512-token context, through the engine's runner
(sampling included; the one-token decode step replayed from its step graph as the engine runs
it):

- the cost of a verify step of k + 1 tokens (k = 1..3: the last token and k drafts, the state
  after each written to its own slot) over a one-token decode step, median of ``--reps``
  alternated runs; each step timed on its second run in a row, replayed from its step graph as
  the engine runs consecutive steps of one shape (``engine.step_graph``), and the first run
  (the Python forward) beside it;
- the tokens/s those costs give at accepted lengths 1.5, 2.0, 2.5, 3.0 (computed: accepted
  length / verify step time at k = 3; an n-gram draft costs no forward), beside one-token
  decoding's;
- measured with the engine (``--speculative-algorithm NGRAM``, k = 3) against without, batch 1
  and batch 16, 64 new tokens: tokens/s and the accept length this model shows (random weights
  rarely repeat, so drafts are rarely kept: the measured figure is the cost side);
- the hit rate of the shared-prefix workload (4 groups x 8 requests, 512 + 64 tokens, 16 new)
  and of a multi-turn one (8 conversations x 3 turns, each turn the previous prompt + its
  answer + 32 new tokens), speculation on and off.

    HF_HUB_OFFLINE=1 python bench/bench_spec.py [--reps 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import checkpoint  # noqa: E402

PRESET = "qwen3_5_0_8b"
CONTEXT = 512


def step_costs(eng, reps: int) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of a runner step at batch 1: key 0 a one-token decode, k a verify of k + 1;
    each run twice in a row: the second (replayed) and the first (the Python forward; its
    shape was not the step before's)."""
    from mambaradix.core import ForwardBatch, ForwardReq, SamplingParams, StateOps
    from mambaradix.engine.batch import RunBatch
    from mambaradix.layout import VerifyReq

    runner, kv, st = eng.runner, eng.kv_pool, eng.state_pool
    vocab = eng.model.vocab_size
    page = kv.page_size
    slots = st.alloc(4)
    kv_slots = kv.alloc(-(-(CONTEXT + 8) // page) * page)
    prompt = [(i * 7919) % (vocab - 10) + 5 for i in range(CONTEXT)]
    greedy = SamplingParams(temperature=0.0)
    batch_id = [1 << 20]

    def run(reqs, drafts=None) -> float:
        batch_id[0] += 1
        batch = RunBatch(batch_id[0], ForwardBatch(reqs, StateOps()), sample_rows=[0],
                         params=[greedy], generators=[None], logit_states=[None],
                         grammars=[None], drafts=drafts or {})  # fmt: skip
        t0 = time.perf_counter()
        runner.submit(batch).result()
        return time.perf_counter() - t0

    run([ForwardReq(0, prompt, kv_slots[:CONTEXT], slots[0], all_logits=False)])
    times: dict[int, list[float]] = {k: [] for k in range(4)}
    first: dict[int, list[float]] = {k: [] for k in range(4)}
    for _ in range(reps + 2):  # the first two rounds warm up
        for k in range(4):
            # twice in a row: the second replays the step graph, as the engine's do
            if k == 0:
                req = ForwardReq(CONTEXT - 1, prompt[-1:], kv_slots[:CONTEXT], slots[0])
                first[k].append(run([req]))
                times[k].append(run([req]))
                continue
            draft = [11 + i for i in range(k)]
            snaps = [(n + 1, slots[1 + n]) for n in range(k)]
            req = VerifyReq(CONTEXT - 1, prompt[-1:] + draft, kv_slots[: CONTEXT + k],
                            slots[0], snaps, all_logits=True)  # fmt: skip
            first[k].append(run([req], {0: draft}))
            times[k].append(run([req], {0: draft}))
    st.free(slots)
    kv.free(kv_slots)
    med = lambda v: statistics.median(v[2:])  # noqa: E731
    return {k: med(v) for k, v in times.items()}, {k: med(v) for k, v in first.items()}


def decode_rate(eng, batch: int, new: int) -> tuple[float, float]:
    """Output tok/s of ``batch`` requests of 128 random tokens and ``new`` new tokens each, and
    the mean accept length (1.0 without speculation)."""
    vocab = eng.model.vocab_size
    rng = random.Random(batch)
    prompts = [[rng.randrange(5, vocab - 5) for _ in range(128)] for _ in range(batch)]
    p = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    before = eng.stats()
    t0 = time.perf_counter()
    eng.generate(input_ids=prompts, sampling_params=[p] * batch)
    seconds = time.perf_counter() - t0
    after = eng.stats()
    verify = after.spec_verify_ct - before.spec_verify_ct
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return batch * new / seconds, accepted / verify if verify else 1.0


def workloads(vocab: int) -> dict[str, list[list[list[int]]]]:
    """Rounds of prompts: the shared-prefix workload in one round; multi-turn in three, each
    turn's prompt built from the previous prompt (answers are filled in as they arrive)."""
    rng = random.Random(3)
    tok = lambda k: [rng.randrange(5, vocab - 5) for _ in range(k)]  # noqa: E731
    systems = [tok(512) for _ in range(4)]
    gsp = [[systems[g] + tok(64) for g in range(4) for _ in range(8)]]
    return {"gsp": gsp, "multi-turn": [[tok(256) for _ in range(8)]]}


def hit_rate(eng, name: str, rounds: list[list[list[int]]]) -> float:
    p = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompt_tokens = cached = 0
    prompts = rounds[0]
    turns = 3 if name == "multi-turn" else 1
    rng = random.Random(9)
    for _ in range(turns):
        outs = eng.generate(input_ids=prompts, sampling_params=[p] * len(prompts))
        for o in outs:
            prompt_tokens += o["meta_info"]["prompt_tokens"]
            cached += o["meta_info"]["cached_tokens"]
        prompts = [pr + o["output_ids"] + [rng.randrange(5, 400) for _ in range(32)]
                   for pr, o in zip(prompts, outs)]  # fmt: skip
    return cached / prompt_tokens


def part(args) -> None:
    """One measurement in this process (a fresh one: an engine's OpenMP pool outlives it)."""
    from mambaradix.engine.engine import Engine

    folder = str(checkpoint(PRESET))
    kw = dict(model_path=folder, num_threads=args.threads, dtype="bfloat16")
    spec = dict(speculative_algorithm="NGRAM", speculative_num_steps=3) if args.spec else {}
    if args.part == "steps":
        with Engine(disable_radix_cache=True, **kw) as eng:
            costs, python = step_costs(eng, args.reps)
            replays = eng.runner.graphs.stats["replayed"] if eng.runner.graphs else 0
        base = costs[0]
        for k in (1, 2, 3):
            ratio = costs[k] / base
            print(
                f"verify k={k} ({k + 1} tokens): {costs[k] * 1e3:.1f} ms = {ratio:.3f}x "
                f"the one-token decode step ({base * 1e3:.1f} ms); first of its shape in a "
                f"row (Python forward) {python[k] * 1e3:.1f} ms = "
                f"{python[k] / python[0]:.3f}x the decode step's ({python[0] * 1e3:.1f} ms)"
            )
        print(f"steps replayed from step graphs: {replays}")
        print(f"decode alone: {1 / base:.2f} tok/s")
        for length in (1.5, 2.0, 2.5, 3.0):
            print(f"computed at accept length {length}: {length / costs[3]:.2f} tok/s "
                  f"({length / costs[3] * base:.2f}x decode)")  # fmt: skip
    elif args.part == "decode":
        with Engine(disable_radix_cache=True, **kw, **spec) as eng:
            rate, length = decode_rate(eng, args.batch, args.new)
        print(f"measured batch {args.batch} {'NGRAM' if spec else 'off'}: {rate:.2f} tok/s "
              f"(accept length {length:.3f})")  # fmt: skip
    else:
        import json

        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        name = args.part
        # overlap off on both sides (speculation turns it off)
        with Engine(disable_overlap_schedule=True, **kw, **spec) as eng:
            rate = hit_rate(eng, name, workloads(vocab)[name])
        print(f"hit rate {name} {'NGRAM' if spec else 'off'}: {rate:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--steps-only", action="store_true", help="only the step costs")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spec", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        part(args)
        return
    import subprocess

    def fresh(*extra: str) -> None:
        cmd = [sys.executable, __file__, "--threads", str(args.threads), "--reps",
               str(args.reps), "--new", str(args.new), *extra]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(out.stdout.strip(), flush=True)

    fresh("--part", "steps")
    if args.steps_only:
        return
    for batch in (1, 16):
        for spec in ((), ("--spec",), (), ("--spec",)):  # alternated, twice
            fresh("--part", "decode", "--batch", str(batch), *spec)
    for name in ("gsp", "multi-turn"):
        for spec in ((), ("--spec",)):
            fresh("--part", name, *spec)


if __name__ == "__main__":
    main()
