"""The state eviction policies (``--state-eviction-policy lru|value``) on two small-pool cases,
on the fake model (tests/engine/fake_model.py: closed-form outputs, no weights), so the figures
are the cache's alone: hit tokens and computed prompt tokens, no timing.

- ``turns``: five chats (64 to 1,024 tokens of history) come back in turn, four rounds, each
  turn adding 16 tokens (LRU's cyclic worst case);
- ``stale``: two 2,048-token documents served once and never again, then 40 short chats
  (64-160 tokens) whose second turn comes after ``gap`` other requests (a case for recency).

    python bench/bench_state_policy.py
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from engine_helpers import GREEDY, fake_engine, rand_tokens  # noqa: E402

PARAMS = {**GREEDY, "ignore_eos": True}


def turns(policy: str, strategy: str, slots: int, seed: int) -> tuple[int, int, int]:
    """(hit tokens, ideal hit tokens, computed prompt tokens) after the first round."""
    rng = random.Random(seed)
    history = [rand_tokens(rng, n) for n in (64, 128, 256, 512, 1024)]
    flags = dict(
        state_eviction_policy=policy, max_mamba_cache_size=slots, mamba_scheduler_strategy=strategy
    )
    hit = ideal = computed = 0
    with fake_engine(**flags) as eng:
        for round_ in range(4):
            start = eng.stats().computed_prefill_tokens
            for i, past in enumerate(history):
                prompt = past + rand_tokens(rng, 16)
                res = eng.generate(input_ids=prompt, sampling_params=PARAMS)
                if round_:
                    hit += res["meta_info"]["cached_tokens"]
                    ideal += len(past) - 1
                history[i] = prompt + res["output_ids"]
            if round_:
                computed += eng.stats().computed_prefill_tokens - start
    return hit, ideal, computed


def stale(policy: str, slots: int, gap: int, seed: int) -> tuple[int, int, int]:
    """(hit tokens, ideal hit tokens, computed prompt tokens) of the chats."""
    rng = random.Random(seed)
    flags = dict(state_eviction_policy=policy, max_mamba_cache_size=slots)
    flags["mamba_scheduler_strategy"] = "no_buffer"
    with fake_engine(**flags) as eng:
        for _ in range(2):
            eng.generate(input_ids=rand_tokens(rng, 2048), sampling_params=PARAMS)
        start = eng.stats().computed_prefill_tokens
        first: list[list[int]] = []
        hit = ideal = 0
        n = 40
        for t in range(n + gap):
            if t < n:
                prompt = rand_tokens(rng, rng.randrange(64, 160))
                res = eng.generate(input_ids=prompt, sampling_params=PARAMS)
                first.append(prompt + res["output_ids"])
            if t >= gap:
                past = first[t - gap]
                res = eng.generate(input_ids=past + rand_tokens(rng, 16), sampling_params=PARAMS)
                hit += res["meta_info"]["cached_tokens"]
                ideal += len(past) - 1
        return hit, ideal, eng.stats().computed_prefill_tokens - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rows = []
    for strategy, slots in (("no_buffer", 5), ("extra_buffer", 8), ("extra_buffer", 12)):
        for policy in ("lru", "value"):
            rows.append((f"turns {strategy} {slots} slots", policy,
                         *turns(policy, strategy, slots, args.seed)))  # fmt: skip
    for slots, gap in ((8, 2), (8, 4), (12, 4), (12, 8)):
        for policy in ("lru", "value"):
            rows.append((f"stale {slots} slots gap {gap}", policy,
                         *stale(policy, slots, gap, args.seed)))  # fmt: skip
    print(f"{'case':<28}{'policy':<8}{'hit':>8}{'ideal':>8}{'computed':>10}")
    for case, policy, hit, ideal, computed in rows:
        print(f"{case:<28}{policy:<8}{hit:>8}{ideal:>8}{computed:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
