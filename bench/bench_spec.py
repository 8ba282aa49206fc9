"""Speculative decoding at real size: what a verify step costs and what it yields.

On the real-size Qwen3.5-0.8B-shaped preset (bench_real's checkpoint: random bf16 weights,
bf16, ``--threads`` threads), batch 1 at a 512-token context (``--context``), through the
engine's runner (sampling included; the one-token decode step replayed from its step graph as
the engine runs it):

- the cost of a verify step of k + 1 tokens (k = 1..3: the last token and k drafts, the state
  after each written to its own slot) over a one-token decode step: the median over ``--reps``
  rounds of each verify step's time over the decode step's timed just before it; each step
  timed on its second run in a row, replayed from its step graph as the engine runs
  consecutive steps of one shape (``engine.step_graph``), and the same ratio of the first runs
  (the Python forward) beside it;
- with ``--parts``, where those steps' time goes: each step graph's calls timed one by one and
  summed by kernel (native function or torch op), the decode graph run before each verify
  graph as the engine alternates them;
- the tokens/s those costs give at accepted lengths 1.5, 2.0, 2.5, 3.0 (computed: accepted
  length / (the k = 3 ratio x the decode step time); an n-gram draft costs no forward), beside
  one-token decoding's;
- measured with the engine (``--speculative-algorithm NGRAM``, k = 3) against without, batch 1
  and batch 16, 64 new tokens: tokens/s and the accept length this model shows (random weights
  rarely repeat, so drafts are rarely kept: the measured figure is the cost side);
- measured on a workload whose output repeats its prompt (``--part repeat``: the same preset
  with its LM head rewired so that greedy decoding walks a fixed cycle of token ids, the prompt
  that cycle repeated; every layer still computes as in the preset): NGRAM at k = 1, 2, 3
  against one-token decoding, batch 1 and 16 (``--batches``), tokens/s and the accept length
  it shows (where speculation stops paying: ``--speculative-disable-by-batch-size``);
- with ``--adaptive``, the repeat workload and the measured decode also with
  ``--speculative-adaptive`` (at the largest k), twice in a row as a restarted server would
  run: "fresh" measures its step costs from nothing, "kept" starts from the costs the fresh
  run left (``--speculative-adaptive-costs``, a file of the benchmark's own). The cap it
  settles on should give the better of speculation and one-token decoding at each batch size;
- the hit rate of the shared-prefix workload (4 groups x 8 requests, 512 + 64 tokens, 16 new)
  and of a multi-turn one (8 conversations x 3 turns, each turn the previous prompt + its
  answer + 32 new tokens), speculation on and off.

    HF_HUB_OFFLINE=1 python bench/bench_spec.py [--reps 7] [--threads 2]
        [--steps-only | --parts | --repeat-only [--batches 1 4 8 16] [--ks 1 2 3] | --decode-only]
        [--adaptive]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import CACHE, checkpoint  # noqa: E402

PRESET = "qwen3_5_0_8b"
CONTEXT = 512
CYCLE = 32  # token ids in the repeat workload's cycle
EMBED_SCALE = 256.0  # the repeat checkpoint's input embedding over the preset's


def step_costs(eng, reps: int, context: int = CONTEXT) -> dict[str, dict[int, float]]:
    """A runner step at batch 1 after a ``context``-token prompt: 0 a one-token decode, k a
    verify of k + 1 tokens. Each round runs, for k = 1..3, the decode step twice in a row and
    then the verify step twice in a row (the second run of a shape replays its step graph, as
    the engine's steps do; the first is the Python forward). Returns medians over the rounds:
    ``ms`` (second runs), ``ratio`` (each verify over the decode step just before it, so the
    machine's load, which moves within seconds here, cancels) and ``python`` (the same ratio of
    the first runs)."""
    from mambaradix.core import ForwardBatch, ForwardReq, SamplingParams, StateOps
    from mambaradix.engine.batch import RunBatch
    from mambaradix.layout import VerifyReq

    runner, kv, st = eng.runner, eng.kv_pool, eng.state_pool
    vocab = eng.model.vocab_size
    page = kv.page_size
    slots = st.alloc(4)
    kv_slots = kv.alloc(-(-(context + 8) // page) * page)
    prompt = [(i * 7919) % (vocab - 10) + 5 for i in range(context)]
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

    def twice(k: int) -> tuple[float, float]:
        if k == 0:
            req = ForwardReq(context - 1, prompt[-1:], kv_slots[:context], slots[0])
            return run([req]), run([req])
        draft = [11 + i for i in range(k)]
        snaps = [(n + 1, slots[1 + n]) for n in range(k)]
        req = VerifyReq(context - 1, prompt[-1:] + draft, kv_slots[: context + k], slots[0],
                        snaps, all_logits=True)  # fmt: skip
        return run([req], {0: draft}), run([req], {0: draft})

    run([ForwardReq(0, prompt, kv_slots[:context], slots[0], all_logits=False)])
    ms: dict[int, list[float]] = {k: [] for k in range(4)}
    ratio: dict[int, list[float]] = {k: [] for k in range(1, 4)}
    python: dict[int, list[float]] = {k: [] for k in range(1, 4)}
    for rnd in range(reps + 2):  # the first two rounds warm up
        for k in (1, 2, 3):
            d_first, d = twice(0)
            v_first, v = twice(k)
            if rnd < 2:
                continue
            ms[0].append(d * 1e3)
            ms[k].append(v * 1e3)
            ratio[k].append(v / d)
            python[k].append(v_first / d_first)
    st.free(slots)
    kv.free(kv_slots)
    med = statistics.median
    return {
        "ms": {k: med(v) for k, v in ms.items()},
        "ratio": {k: med(v) for k, v in ratio.items()},
        "python": {k: med(v) for k, v in python.items()},
    }


def step_parts(eng, reps: int, context: int = CONTEXT) -> None:
    """Where a step's time goes: the decode step and the verify steps of k + 1 = 2..4 tokens
    (batch 1, as ``step_costs`` records them), each step graph's calls run one by one on the
    runner's thread, timed alone and summed by kernel (a native function, or a torch op). Each
    round runs the decode graph before every verify graph, as the engine alternates them, so
    the weights come from memory as in a decode step. Medians over ``reps`` rounds, in ms."""
    import collections

    import torch

    step_costs(eng, 1, context)  # records the four graphs
    graphs = {len(g.layout.input_ids): g for g in eng.runner.graphs.graphs}
    if sorted(graphs) != [1, 2, 3, 4]:
        raise SystemExit(f"expected the graphs of 1-4 tokens, have {sorted(graphs)}")

    def name_of(fn) -> str:
        return getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__",
                                                        type(fn).__name__)  # fmt: skip

    def timed(graph) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        t_all = time.perf_counter()
        for fn, args in graph.program:
            t = time.perf_counter()
            fn(*args)
            out[name_of(fn)] += time.perf_counter() - t
        out["step"] = time.perf_counter() - t_all
        return out

    @torch.inference_mode()
    def rounds() -> dict[int, dict[str, list[float]]]:
        res: dict[int, dict[str, list[float]]] = {r: collections.defaultdict(list) for r in graphs}
        for _ in range(reps):
            for rows in sorted(graphs):
                decode = timed(graphs[1])
                got = decode if rows == 1 else timed(graphs[rows])
                for name, v in got.items():
                    res[rows][name].append(v)
        return res

    res = eng.runner.on_thread(rounds).result()
    med = statistics.median
    names = sorted(res[4], key=lambda n: -med(res[4][n]))
    print("ms by kernel, one step (tokens: " + " / ".join(str(r) for r in sorted(res)) + ")")
    for name in names[:12]:
        print(f"  {name[:28]:28s} " + " / ".join(f"{med(res[r].get(name, [0.0])) * 1e3:7.2f}"
                                             for r in sorted(res)))  # fmt: skip


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
    return batch * new / seconds, accept_length(before, eng.stats())


def accept_length(before, after) -> float:
    """The mean tokens a verify step emitted between two ``Engine.stats()`` (1.0 without
    speculation)."""
    verify = after.spec_verify_ct - before.spec_verify_ct
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return accepted / verify if verify else 1.0


def cycles(vocab: int, count: int) -> list[list[int]]:
    """``count`` disjoint cycles of CYCLE token ids (seeded)."""
    ids = random.Random(5).sample(range(5, vocab - 5), count * CYCLE)
    return [ids[i * CYCLE : (i + 1) * CYCLE] for i in range(count)]


def repeat_checkpoint() -> Path:
    """The preset with its LM head untied and rewired so that greedy decoding follows the
    cycles of ``cycles(vocab, 16)``: the head's row of each cycle's next id is the embedding of
    the id before it (every other row the embedding's own), and the input embedding is scaled
    by EMBED_SCALE so that the token's own direction outweighs the random layers' sum at the
    last norm (each layer adds a vector of norm ~18 to an embedding of ~0.64). The model then
    continues a prompt made of a cycle with the cycle's next ids: an output that repeats its
    prompt, which an n-gram draft predicts. The layers, the weights read and the compute are
    the preset's; only the two tables' values differ (built once)."""
    import json

    from safetensors.torch import load_file, save_file

    folder = CACHE / f"real-{PRESET}-repeat-v2"
    if (folder / "config.json").is_file():
        return folder
    src = checkpoint(PRESET)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    head = embed.clone()
    for cyc in cycles(embed.shape[0], 16):
        for i, tok in enumerate(cyc):
            head[cyc[(i + 1) % CYCLE]] = embed[tok]
    tensors["lm_head.weight"] = head
    tensors["model.embed_tokens.weight"] = (embed.float() * EMBED_SCALE).to(embed.dtype)
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(folder)
    return folder


def repeat_rate(eng, batch: int, new: int) -> tuple[float, float, float]:
    """Decode tok/s of ``batch`` requests, each prompt its own cycle four times over (128
    tokens), ``new`` new tokens each: a warm-up run (step graphs recorded), then the prompts
    with one new token (the prefill and first token) and with ``new``; the rate is the tokens
    after the first over the difference. Also the mean accept length of that run and the share
    of its output tokens that continue the cycle (what makes the workload repeat its prompt)."""
    vocab = eng.model.vocab_size
    cycs = cycles(vocab, 16)[:batch]
    prompts = [c * 4 for c in cycs]

    def run(n: int) -> tuple[float, list[dict]]:
        p = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=[p] * batch)
        return time.perf_counter() - t0, outs

    run(new)
    first, _ = run(1)
    before = eng.stats()
    seconds, outs = run(new)
    length = accept_length(before, eng.stats())
    follow = sum(o == c[i % CYCLE] for out, c in zip(outs, cycs)
                 for i, o in enumerate(out["output_ids"]))  # fmt: skip
    return batch * (new - 1) / (seconds - first), length, follow / (batch * new)


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
    name = "NGRAM" if spec else "off"
    if args.spec and args.adaptive:
        costs = Path(args.costs)
        if args.fresh:
            costs.unlink(missing_ok=True)
        spec.update(speculative_adaptive=True, speculative_adaptive_costs=str(costs))
        name += " adaptive " + ("fresh" if args.fresh else "kept")
    if args.part == "parts":
        with Engine(disable_radix_cache=True, **kw) as eng:
            step_parts(eng, args.reps, args.context)
    elif args.part == "steps":
        with Engine(disable_radix_cache=True, **kw) as eng:
            costs = step_costs(eng, args.reps, args.context)
            replays = eng.runner.graphs.stats["replayed"] if eng.runner.graphs else 0
        ms, ratio, python = costs["ms"], costs["ratio"], costs["python"]
        for k in (1, 2, 3):
            print(f"verify k={k} ({k + 1} tokens): {ms[k]:.1f} ms = {ratio[k]:.3f}x the one-token "
                  f"decode step ({ms[0]:.1f} ms); first of its shape in a row (Python forward) "
                  f"{python[k]:.3f}x the decode step's")  # fmt: skip
        print(f"steps replayed from step graphs: {replays}")
        rate = 1e3 / ms[0]
        print(f"decode alone: {rate:.2f} tok/s")
        for length in (1.5, 2.0, 2.5, 3.0):
            print(f"computed at accept length {length}: {length / ratio[3] * rate:.2f} tok/s "
                  f"({length / ratio[3]:.2f}x decode)")  # fmt: skip
    elif args.part == "decode":
        with Engine(disable_radix_cache=True, **kw, **spec) as eng:
            rate, length = decode_rate(eng, args.batch, args.new)
        print(f"measured batch {args.batch} {name}: {rate:.2f} tok/s "
              f"(accept length {length:.3f})")  # fmt: skip
    elif args.part == "repeat":
        kw["model_path"] = str(repeat_checkpoint())
        if spec:
            spec["speculative_num_steps"] = args.k
        with Engine(disable_radix_cache=True, **kw, **spec) as eng:
            rate, length, follow = repeat_rate(eng, args.batch, args.new)
        label = f"{name} k={args.k}" if spec else "off"
        print(f"repeat workload, batch {args.batch} {label}: {rate:.2f} tok/s after the first "
              f"token (accept length {length:.3f}; {follow:.3f} of the output continues the "
              f"prompt's cycle)")  # fmt: skip
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
    ap.add_argument(
        "--context",
        type=int,
        default=CONTEXT,
        help="prompt tokens before the timed steps (--steps-only, --parts)",
    )
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--steps-only", action="store_true", help="only the step costs")
    ap.add_argument("--parts", action="store_true",
                    help="only where the steps' time goes, by kernel")  # fmt: skip
    ap.add_argument("--repeat-only", action="store_true",
                    help="only the workload whose output repeats its prompt")  # fmt: skip
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16],
                    help="the repeat workload's batch sizes")  # fmt: skip
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3],
                    help="the repeat workload's draft lengths")  # fmt: skip
    ap.add_argument("--adaptive", action="store_true",
                    help="also measure --speculative-adaptive (at the largest k)")  # fmt: skip
    ap.add_argument("--decode-only", action="store_true",
                    help="only the measured decode of random prompts")  # fmt: skip
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spec", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--k", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--costs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        part(args)
        return
    import subprocess

    def fresh(*extra: str) -> None:
        cmd = [sys.executable, __file__, "--threads", str(args.threads), "--reps",
               str(args.reps), "--new", str(args.new), "--context", str(args.context),
               *extra]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(out.stdout.strip(), flush=True)

    costs = str(CACHE / "bench-spec-costs.json")  # the fresh run's costs, the kept run's start
    kinds = (("--fresh",), ()) if args.adaptive else ()
    adaptive = [("--spec", "--adaptive", "--costs", costs, *kind) for kind in kinds]
    if args.parts:
        fresh("--part", "parts")
        return
    if not (args.repeat_only or args.decode_only):
        fresh("--part", "steps")
    if args.steps_only:
        return
    if not args.decode_only:
        repeat_checkpoint()
        for batch in args.batches:
            for _ in range(2):  # alternated, twice
                fresh("--part", "repeat", "--batch", str(batch))
                for k in args.ks:
                    fresh("--part", "repeat", "--batch", str(batch), "--spec", "--k", str(k))
                for extra in adaptive:
                    fresh("--part", "repeat", "--batch", str(batch), "--k", str(max(args.ks)),
                          *extra)  # fmt: skip
    if args.repeat_only:
        return
    for batch in (1, 16) if not args.decode_only else args.batches:
        for _ in range(2):  # alternated, twice
            for spec in [(), ("--spec",), *adaptive]:
                fresh("--part", "decode", "--batch", str(batch), *spec)
    if args.decode_only:
        return
    for name in ("gsp", "multi-turn"):
        for spec in ((), ("--spec",)):
            fresh("--part", name, *spec)


if __name__ == "__main__":
    main()
