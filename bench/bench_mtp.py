"""Speculative decoding with the MTP head at real size: what its steps cost and what they yield.

On the real-size Qwen3.5-0.8B-shaped preset (bench_real's checkpoint) with an MTP layer of the
published shape added (``mtp.*``: seeded random, bf16), ``--threads`` threads, batch 1 at a
512-token context, through the engine's runner with ``--speculative-algorithm MTP``:

- the one-token decode step (replayed from its step graph, as the engine runs it; it includes
  the head's row of the new token, ``MtpHead.extend``), the verify step of k + 1 tokens
  (k = 1..3) with and without its draft steps (each a ratio to the decode step run just
  before it, the median over rounds: the machine's load moves within seconds), and one draft
  step (the head's chained step, timed inside
  ``DraftHead.fill``), with the whole vocabulary and with a token map of ``--map-size`` ids
  (``--speculative-token-map``; random weights have no frequent tokens: ids 0..n-1);
- the tokens/s those costs give at accepted lengths 1.5 .. 3.0 (computed: accepted length /
  (k draft steps + the verify step) at k = 3), beside one-token decoding's;
- measured with the engine against without, batch 1 and 16, 64 new tokens (random weights
  accept almost no draft: the measured figure is the cost side);
- the hit rate of bench_spec's shared-prefix and multi-turn workloads, MTP on and off.

    HF_HUB_OFFLINE=1 python bench/bench_mtp.py [--reps 7] [--threads 2] [--map-size 32768]
        [--steps-only | --decode-only] [--batches 1 16] [--adaptive]

With ``--adaptive`` the measured decode also runs ``--speculative-adaptive``: random weights
keep almost no draft, so it should settle on cap 0 and decode near one-token decoding's rate.
It runs twice in a row as a restarted server would: "fresh" measures its step costs from
nothing, "kept" starts from the costs the fresh run left (``--speculative-adaptive-costs``, a
file of the benchmark's own); each prints the draft tokens it verified a new token, what
trying shapes early costs whatever the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import CACHE, checkpoint  # noqa: E402
from bench_spec import PRESET, decode_rate, hit_rate, step_costs, workloads  # noqa: E402


def mtp_checkpoint() -> Path:
    """bench_real's preset with the published MTP head's tensors added (built once)."""
    from transformers import AutoConfig

    from mambaradix.models.tiny import _add_mtp
    from mambaradix.models.tiny_configs import _qwen_mtp

    folder = CACHE / f"real-{PRESET}-mtp-v1"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint(PRESET), tmp)
    _add_mtp(tmp, AutoConfig.from_pretrained(tmp), _qwen_mtp, seed=0)
    tmp.rename(folder)
    return folder


def token_map(size: int) -> str:
    path = CACHE / f"token-map-{size}.json"
    if not path.is_file():
        path.write_text(json.dumps(list(range(size))))
    return str(path)


def part(args) -> None:
    """One measurement in this process (a fresh one: an engine's OpenMP pool outlives it)."""
    from mambaradix.engine.engine import Engine

    folder = str(mtp_checkpoint())
    kw = dict(model_path=folder, num_threads=args.threads, dtype="bfloat16")
    spec = dict(speculative_algorithm="MTP", speculative_num_steps=3) if args.spec else {}
    if args.map:
        spec["speculative_token_map"] = token_map(args.map_size)
    if args.spec and args.adaptive:
        costs = Path(args.costs)
        if args.fresh:
            costs.unlink(missing_ok=True)
        spec.update(speculative_adaptive=True, speculative_adaptive_costs=str(costs))
    label = "off"
    if args.spec:
        label = "MTP" + (f", map {args.map_size}" if args.map else "")
        label += (", adaptive " + ("fresh" if args.fresh else "kept")) if args.adaptive else ""
    if args.part == "steps":
        with Engine(disable_radix_cache=True, **kw, **spec) as eng:
            head = eng.runner.draft_head
            fill, drafted = head.fill, []

            def timed(batch) -> None:
                t0 = time.perf_counter()
                fill(batch)
                drafted.append((time.perf_counter() - t0, sum(map(len, batch.drafts.values()))))

            head.fill = timed
            with_drafts = step_costs(eng, args.reps)  # verify steps with their draft steps
            head.fill = lambda batch: None  # the verify alone (of the bench's fixed drafts)
            alone = step_costs(eng, args.reps)["ratio"]
        costs = with_drafts["ms"]
        second = drafted[1::2]  # each verify shape runs twice in a row: the second replays
        draft = 1e3 * statistics.median(s / n for s, n in second if n)
        base = costs[0]
        print(
            f"[{label}] decode step {base:.1f} ms; draft step {draft:.2f} ms = {draft / base:.3f}x"
        )
        for k in (1, 2, 3):  # ratios to the decode step run just before, medians over rounds
            print(
                f"[{label}] verify k={k}: {alone[k]:.3f}x the decode step; with its {k} "
                f"draft steps {with_drafts['ratio'][k]:.3f}x"
            )
        cycle = with_drafts["ratio"][3]  # 3 draft steps and the verify, in decode steps
        for length in (1.5, 2.0, 2.5, 3.0):
            print(
                f"[{label}] computed at accept length {length}: {length / cycle:.2f}x "
                f"decode ({length / cycle * 1e3 / base:.2f} tok/s at its {1e3 / base:.2f})"
            )
    elif args.part == "decode":
        with Engine(disable_radix_cache=True, **kw, **spec) as eng:
            rate, length = decode_rate(eng, args.batch, args.new)
            drafts = eng.stats().spec_draft_tokens / (args.batch * args.new)
        print(
            f"measured batch {args.batch} [{label}]: {rate:.2f} tok/s (accept length {length:.3f}"
            f"; {drafts:.3f} draft tokens verified a new token)"
        )
    else:
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        with Engine(disable_overlap_schedule=True, **kw, **spec) as eng:
            rate = hit_rate(eng, args.part, workloads(vocab)[args.part])
        print(f"hit rate {args.part} [{label}]: {rate:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--map-size", type=int, default=32768)
    ap.add_argument("--steps-only", action="store_true", help="only the step costs")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16],
                    help="the measured decode's batch sizes")  # fmt: skip
    ap.add_argument("--adaptive", action="store_true",
                    help="also measure --speculative-adaptive")  # fmt: skip
    ap.add_argument("--decode-only", action="store_true", help="only the measured decode")
    ap.add_argument("--part", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spec", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--map", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--costs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        part(args)
        return
    mtp_checkpoint()

    def fresh(*extra: str) -> None:
        cmd = [
            sys.executable,
            __file__,
            "--threads",
            str(args.threads),
            "--reps",
            str(args.reps),
            "--new",
            str(args.new),
            "--map-size",
            str(args.map_size),
            *extra,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(out.stdout.strip(), flush=True)

    if not args.decode_only:
        fresh("--part", "steps", "--spec")
        fresh("--part", "steps", "--spec", "--map")
    if args.steps_only:
        return
    sides = [(), ("--spec", "--map")]
    if args.adaptive:  # the fresh run's costs are the kept run's start
        costs = str(CACHE / "bench-mtp-costs.json")
        sides += [("--spec", "--map", "--adaptive", "--costs", costs, *kind)
                  for kind in (("--fresh",), ())]  # fmt: skip
    for batch in args.batches:
        for _ in range(2):  # alternated, twice
            for spec in sides:
                fresh("--part", "decode", "--batch", str(batch), *spec)
    if args.decode_only:
        return
    for name in ("gsp", "multi-turn"):
        for spec in ((), ("--spec", "--map")):
            fresh("--part", name, *spec)


if __name__ == "__main__":
    main()
