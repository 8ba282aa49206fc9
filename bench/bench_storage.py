"""The storage tier at real size (a published configuration with random bf16 weights,
``bench_real``'s presets; default Qwen3.5-0.8B-shaped), one mode at a time or all:

- ``restart``: W1 (4 groups x 8 requests, 512-token system prompt + 64-token question, 16 new
  tokens, all at once) in one process, which then shuts down (the default write_back policy
  writes what RAM holds); a new process on the same storage
  directory runs W1 with new questions. Beside it, the same second W1 in the first process
  without a restart (RAM warm). Prints both wall times, their ratio and the prompt tokens each
  computed (the ideal after the restart: the questions only, 2,048).
- ``load``: one prompt of 512 and one of 4,096 tokens: the time to compute it (prefill, cache
  off) against the time a fresh engine takes to load it back from storage, per token.
- ``beyond``: ``--groups`` distinct 1,024-token system prompts x ``--per-group`` requests with
  64-token questions, interleaved (group after group, then again), one after another, with a
  state pool holding 1/8 of the states the workload keeps; hit rate and TTFT p50 / p99 with
  the tier, without it, and with unlimited RAM.
- ``shared``: two engines in one process (two replicas) sharing one storage directory,
  requests alternated between them (round robin), against one engine alone: hit rates.
- ``overhead``: W1, which fits in RAM, tier on (``--policy``, default the engine's default,
  write_back) against tier off, engines alternated in one process over ``--rounds`` rounds:
  wall times, the tier-on side including the writes still running at its end.

    python bench/bench_storage.py                         # every mode
    python bench/bench_storage.py --modes load restart --preset qwen3_5_0_8b
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import bench_real  # noqa: E402

GEN = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
ONE = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def line(mode: str, what: str, **fields: object) -> None:
    body = "  ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )
    print(f"[{mode}] {what:<28} {body}", flush=True)


def engine(folder: Path, threads: int, storage: str | None, **flags):
    from mambaradix.engine.engine import Engine

    if storage is not None:
        flags.update(enable_hierarchical_cache=True, hicache_storage_dir=storage)
    return Engine(model_path=str(folder), num_threads=threads, dtype="bfloat16", **flags)


def shared_engine(model, tok, threads: int, storage: str | None, **flags):
    from mambaradix.engine.engine import Engine

    if storage is not None:
        flags.update(enable_hierarchical_cache=True, hicache_storage_dir=storage)
    return Engine(model=model, tokenizer=tok, num_threads=threads, **flags)


def w1(vocab: int, seed: int) -> list[list[int]]:
    """W1's prompts: the same four system prompts always, questions drawn from ``seed``."""
    systems = bench_real.w1_workload(vocab)[::8]
    rng = random.Random(seed)
    return [
        systems[g][:512] + [rng.randrange(5, vocab - 5) for _ in range(64)]
        for g in range(4)
        for _ in range(8)
    ]


def timed_generate(eng, prompts, params=GEN) -> tuple[float, int, list]:
    before = eng.stats().computed_prefill_tokens
    t0 = time.perf_counter()
    outs = eng.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
    return time.perf_counter() - t0, eng.stats().computed_prefill_tokens - before, outs


# --------------------------------------------------------------------------- restart

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[4])
import bench_storage as b
from pathlib import Path
folder, storage, threads, role = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[5]
with b.engine(folder, threads, storage) as eng:  # the default policy; exit = shutdown
    vocab = eng.model.vocab_size
    out = {}
    if role in ("first", "warm"):
        out["first"] = b.timed_generate(eng, b.w1(vocab, 1))[:2]
    if role in ("warm", "restarted"):
        t, computed, outs = b.timed_generate(eng, b.w1(vocab, 2))
        out["second"] = [t, computed]
        details = [o["meta_info"]["cached_tokens_details"] for o in outs]
        out["storage_tokens"] = sum(d["storage"] for d in details)
print(json.dumps(out))
"""


def child(folder: Path, storage: str, threads: int, role: str) -> dict:
    here = str(Path(__file__).parent)
    got = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), storage, str(threads), here, role],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(got.stdout.strip().splitlines()[-1])


def mode_restart(folder: Path, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as warm_dir, tempfile.TemporaryDirectory() as dir_:
        warm = child(folder, warm_dir, args.threads, "warm")
        first = child(folder, dir_, args.threads, "first")
        restarted = child(folder, dir_, args.threads, "restarted")
    line("restart", "W1 first run", seconds=first["first"][0], computed=first["first"][1])
    line("restart", "W1 new questions, warm", seconds=warm["second"][0], computed=warm["second"][1])
    line(
        "restart", "W1 new questions, restarted",
        seconds=restarted["second"][0], computed=restarted["second"][1],
        from_storage=restarted["storage_tokens"],
        ratio_to_warm=restarted["second"][0] / warm["second"][0],
    )  # fmt: skip


# --------------------------------------------------------------------------- load


def mode_load(folder: Path, args: argparse.Namespace) -> None:
    from mambaradix.models.loader import load_model, load_tokenizer

    model, tok = load_model(str(folder), dtype="bfloat16"), load_tokenizer(str(folder))
    vocab = model.vocab_size
    with tempfile.TemporaryDirectory() as dir_:
        for n in (512, 4096):
            ids = [(i * 7919 + n) % (vocab - 10) + 5 for i in range(n + 1)]
            with shared_engine(
                model, tok, args.threads, dir_, hicache_write_policy="write_through"
            ) as eng:
                t_compute, computed, _ = timed_generate(eng, [ids], ONE)
                eng.cache.storage.drain(120)
            with shared_engine(model, tok, args.threads, dir_) as eng:
                t_total, computed2, outs = timed_generate(eng, [ids], ONE)
                s = eng.stats()
            loaded = outs[0]["meta_info"]["cached_tokens_details"]["storage"]
            line(
                "load", f"{n} tokens",
                compute_s=t_compute, computed=computed,
                load_s=s.storage_load_seconds, loaded=loaded, read_mb=s.storage_bytes_read / 1e6,
                compute_ms_per_tok=1e3 * t_compute / max(computed, 1),
                load_ms_per_tok=1e3 * s.storage_load_seconds / max(loaded, 1),
                ratio=(s.storage_load_seconds / max(loaded, 1)) / (t_compute / max(computed, 1)),
                request_s_after_load=t_total,
            )  # fmt: skip


# --------------------------------------------------------------------------- beyond RAM


def beyond_workload(vocab: int, groups: int, per_group: int) -> list[list[int]]:
    rng = random.Random(7)
    tok = lambda k: [rng.randrange(5, vocab - 5) for _ in range(k)]  # noqa: E731
    systems = [tok(1024) for _ in range(groups)]
    return [systems[g] + tok(64) for _ in range(per_group) for g in range(groups)]


def run_sequential(eng, prompts) -> tuple[float, list[float], int, int]:
    ttfts, cached, total = [], 0, 0
    t0 = time.perf_counter()
    for p in prompts:
        s = time.perf_counter()
        out = eng.generate(input_ids=p, sampling_params=ONE)
        ttfts.append(time.perf_counter() - s)
        cached += out["meta_info"]["cached_tokens"]
        total += len(p)
    return time.perf_counter() - t0, ttfts, cached, total


def mode_beyond(folder: Path, args: argparse.Namespace) -> None:
    from mambaradix.models.loader import load_model, load_tokenizer

    model, tok = load_model(str(folder), dtype="bfloat16"), load_tokenizer(str(folder))
    prompts = beyond_workload(model.vocab_size, args.groups, args.per_group)
    # The workload keeps ~2 states per group (the branch point and the exact repeat point);
    # the small pool holds 1/8 of them beside one running request.
    small = max(2, 2 * args.groups // 8) + 1
    sides = [
        ("unlimited RAM", None, {}),
        ("small RAM + tier", "dir",
         dict(max_mamba_cache_size=small, hicache_write_policy="write_back")),
        ("small RAM, no tier", None, dict(max_mamba_cache_size=small)),
    ]  # fmt: skip
    for name, storage, flags in sides:
        with tempfile.TemporaryDirectory() as dir_:
            with shared_engine(model, tok, args.threads, dir_ if storage else None,
                               mamba_scheduler_strategy="no_buffer", **flags) as eng:  # fmt: skip
                wall, ttfts, cached, total = run_sequential(eng, prompts)
                s = eng.stats()
        q = statistics.quantiles(ttfts, n=100)
        line(
            "beyond", name, state_slots=flags.get("max_mamba_cache_size", "auto"),
            hit_rate=cached / total, ttft_p50=statistics.median(ttfts), ttft_p99=q[98],
            wall_s=wall, storage_hit_tokens=s.storage_hit_tokens, evicted_states=s.evicted_states,
        )  # fmt: skip


# --------------------------------------------------------------------------- shared


def mode_shared(folder: Path, args: argparse.Namespace) -> None:
    from mambaradix.models.loader import load_model, load_tokenizer

    model, tok = load_model(str(folder), dtype="bfloat16"), load_tokenizer(str(folder))
    # 5 groups over 2 replicas: round robin sends each group to both
    prompts = beyond_workload(model.vocab_size, 5, 4)
    for name, n in (("one replica", 1), ("two replicas, shared tier", 2), ("two, private", 2)):
        with tempfile.TemporaryDirectory() as dir_:
            storage = dir_ if name.endswith("tier") else None
            engines = [shared_engine(model, tok, args.threads, storage) for _ in range(n)]
            cached = total = 0
            for i, p in enumerate(prompts):  # round robin
                out = engines[i % n].generate(input_ids=p, sampling_params=ONE)
                cached += out["meta_info"]["cached_tokens"]
                total += len(p)
                if storage:
                    engines[i % n].cache.storage.drain(60)
            for e in engines:
                e.shutdown()
        line("shared", name, hit_rate=cached / total)


# --------------------------------------------------------------------------- overhead


def mode_overhead(folder: Path, args: argparse.Namespace) -> None:
    from mambaradix.models.loader import load_model, load_tokenizer

    model, tok = load_model(str(folder), dtype="bfloat16"), load_tokenizer(str(folder))
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        order = ("on", "off") if r % 2 else ("off", "on")
        for side in order:
            # a fresh directory each time: nothing stored by an earlier round may be found
            with tempfile.TemporaryDirectory() as dir_:
                storage = dir_ if side == "on" else None
                flags = dict(hicache_write_policy=args.policy) if storage else {}
                with shared_engine(model, tok, args.threads, storage, **flags) as eng:
                    t, _, _ = timed_generate(eng, w1(model.vocab_size, 10 + r))
                    if storage:  # the writes still running count too (steady state)
                        t0 = time.perf_counter()
                        eng.cache.storage.drain(300)
                        t += time.perf_counter() - t0
                    written = eng.stats().storage_bytes_written if storage else 0
                    if storage:
                        c = eng.cache.storage.snapshot_counters()
                        line("overhead", f"round {r} probes", probes=c.probes,
                             probe_ms=1e3 * c.probe_seconds,
                             of_wall=c.probe_seconds / t)  # fmt: skip
            times[side].append(t)
            if storage:
                line("overhead", f"round {r} tier on", seconds=t, mb_written=written / 1e6)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    line("overhead", f"W1 in RAM, {args.policy}", tier_on_s=on, tier_off_s=off, ratio=on / off,
         rounds=args.rounds)  # fmt: skip


MODES = {"load": mode_load, "restart": mode_restart, "beyond": mode_beyond,
         "shared": mode_shared, "overhead": mode_overhead}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--preset", default="qwen3_5_0_8b", choices=list(bench_real.PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--groups", type=int, default=16, help="beyond: distinct system prompts")
    ap.add_argument("--per-group", type=int, default=3, help="beyond: requests per prompt")
    ap.add_argument("--rounds", type=int, default=4, help="overhead: alternated rounds")
    ap.add_argument("--policy", default="write_back", help="overhead: --hicache-write-policy")
    args = ap.parse_args()
    folder = bench_real.checkpoint(args.preset)
    import subprocess as sp

    commit = sp.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"# bench_storage {args.preset} threads={args.threads} commit={commit.stdout.strip()}")
    for mode in args.modes:
        MODES[mode](folder, args)


if __name__ == "__main__":
    main()
