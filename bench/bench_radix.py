"""Microbenchmark of the radix tree: replays seeded request traces against trees held at a
target node count and prints microseconds per match / insert / evict_kv / evict_state.

Workloads, interleaved per request (weights 4 : 4 : 2):
  shared  groups sharing a system prompt, each request = system prompt + question + answer
  chat    multi-turn chats, each turn = whole history + user message + answer
  random  unrelated prompts (no sharing)

Each request does what the engine does: match (limit len-1), lock, allocate its own KV and a
state slot (evicting when short), insert prompt + answer with the state, unlock. The tree is
filled to the target node count first (untimed); its KV tokens and states then are the budgets:
after every request, evict_kv / evict_state remove the excess.

    python bench/bench_radix.py            # trees of 1k, 10k, 100k nodes, 50k requests each
    python bench/bench_radix.py --quick    # 1k and 10k nodes, 5k requests each
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from mambaradix.cache.evict_policy import STATE_POLICIES
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.radix import RadixTree
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec

VOCAB = 32000
TINY_KV = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1)
TINY_STATE = StateSpec(layers=(StateLayerSpec(conv_shape=(1, 1)),))
AIM_BASE_US, AIM_PER_TOKEN_US = 20.0, 0.05


@dataclass
class Timings:
    us: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # tokens passed, or entries freed


class Trace:
    """Seeded generator of request token sequences (prompt, answer)."""

    def __init__(self, seed: int, page: int) -> None:
        self.rng = random.Random(seed)
        self.ids = list(range(VOCAB))  # shared int objects: lists of tokens stay small
        self.page = page
        self.systems = [self.rand(128) for _ in range(64)]
        self.chats: list[list[int]] = [[] for _ in range(256)]

    def rand(self, n: int) -> list[int]:
        return self.rng.choices(self.ids, k=n)

    def next(self) -> tuple[list[int], list[int]]:
        kind = self.rng.random()
        if kind < 0.4:
            prompt = self.rng.choice(self.systems) + self.rand(self.rng.randint(16, 64))
        elif kind < 0.8:
            i = self.rng.randrange(len(self.chats))
            if len(self.chats[i]) > 640:
                self.chats[i] = []
            prompt = self.chats[i] + self.rand(self.rng.randint(16, 48))
            self.chats[i] = prompt  # the answer is appended below
        else:
            prompt = self.rand(self.rng.randint(32, 256))
        n = self.rng.randint(8, 32)
        answer = self.rand(n + (-(len(prompt) + n)) % self.page)  # whole pages in all
        if kind >= 0.4 and kind < 0.8:
            self.chats[i] = prompt + answer
        return prompt, answer


class Bench:
    def __init__(self, nodes: int, page: int, seed: int, policy: str = "lru") -> None:
        self.target = nodes
        kv_size = max(200_000, nodes * 100) // page * page  # the node cap should bind first
        self.kv_pool = KVPool(TINY_KV, kv_size, page_size=page)
        self.state_pool = StatePool(TINY_STATE, nodes + 64)
        self.tree = RadixTree(self.kv_pool, self.state_pool, page_size=page, state_policy=policy)
        self.trace = Trace(seed, page)
        self.t = {k: Timings() for k in ("match", "insert", "evict_kv", "evict_state")}
        self.cached = 0
        self.kv_budget: int | None = None  # set after the fill: tree totals kept under these
        self.state_budget = 0
        self.prompt_tokens = 0

    def _evict_kv(self, n: int, timed: bool) -> None:
        nodes = self.tree.num_nodes()
        t0 = time.perf_counter_ns()
        self.tree.evict_kv(n)
        if timed:
            self.t["evict_kv"].us.append((time.perf_counter_ns() - t0) / 1e3)
            self.t["evict_kv"].sizes.append(nodes - self.tree.num_nodes())

    def _alloc_kv(self, n: int, timed: bool) -> torch.Tensor:
        short = n - self.kv_pool.available()
        if short > 0:
            self._evict_kv(short, timed)
        slots = self.kv_pool.alloc(n)
        assert slots is not None, "KV pool too small for one request"
        return slots

    def _evict_state(self, n: int, timed: bool) -> None:
        t0 = time.perf_counter_ns()
        freed = self.tree.evict_state(n)
        if timed:
            self.t["evict_state"].us.append((time.perf_counter_ns() - t0) / 1e3)
            self.t["evict_state"].sizes.append(freed)

    def _alloc_state(self, timed: bool) -> int:
        if self.state_pool.available() == 0:
            self._evict_state(1, timed)
        got = self.state_pool.alloc(1)
        assert got is not None, "state pool exhausted by locks"
        return got[0]

    def request(self, timed: bool) -> None:
        tree = self.tree
        prompt, answer = self.trace.next()
        t0 = time.perf_counter_ns()
        m = tree.match(prompt, limit=len(prompt) - 1)
        t1 = time.perf_counter_ns()
        tree.lock(m.node)
        tree.lock_state(m.node)
        seq = prompt + answer
        own = self._alloc_kv(len(seq) - m.prefix_len, timed)
        tree.unlock_state(m.node)  # the resume copy has run
        state = self._alloc_state(timed)
        kv = torch.cat([m.kv_slots, own])
        t2 = time.perf_counter_ns()
        res = tree.insert(seq, kv, state, owned_from=m.prefix_len)
        t3 = time.perf_counter_ns()
        if not res.state_attached:
            self.state_pool.free([state])
        tree.unlock(m.node)
        if self.kv_budget is not None:
            excess = tree.total_kv() - self.kv_budget
            if excess > 0:
                self._evict_kv(excess, timed)
            excess = tree.total_state() - self.state_budget
            if excess > 0:
                self._evict_state(excess, timed)
        if timed:
            self.t["match"].us.append((t1 - t0) / 1e3)
            self.t["match"].sizes.append(len(prompt))
            self.t["insert"].us.append((t3 - t2) / 1e3)
            self.t["insert"].sizes.append(len(seq))
            self.cached += m.prefix_len
            self.prompt_tokens += len(prompt)


def report(nodes: int, bench: Bench, requests: int, seconds: float) -> None:
    """One fixed-format table. match/insert: ``size`` = tokens per call, ``in_aim`` = share of
    calls under their own aim (20 us + 0.05 us/token), ``ok`` when the median call meets the aim
    of the mean size. Evictions: ``size`` = entries freed per call (nodes for evict_kv, states
    for evict_state), ``us/entry`` = total time / entries freed (O(1) amortized if flat across
    tree sizes)."""
    tree = bench.tree
    print(
        f"\n=== tree ~{nodes} nodes (now {tree.num_nodes()}, {tree.total_kv()} KV tokens, "
        f"{tree.total_state()} states), {requests} requests, {seconds:.1f} s, "
        f"hit rate {bench.cached / max(1, bench.prompt_tokens):.3f}"
    )
    print(
        f"{'op':<12}{'calls':>8}{'mean_us':>10}{'p50_us':>9}{'p99_us':>10}{'size':>8}"
        f"{'aim_us':>8}{'in_aim':>8}{'us/entry':>10}  ok"
    )
    for name, t in bench.t.items():
        if not t.us:
            print(f"{name:<12}{0:>8}")
            continue
        mean = statistics.fmean(t.us)
        qs = statistics.quantiles(t.us, n=100) if len(t.us) > 1 else [t.us[0]] * 99
        size = statistics.fmean(t.sizes)
        if name in ("match", "insert"):
            aim = AIM_BASE_US + AIM_PER_TOKEN_US * size
            within = sum(us <= AIM_BASE_US + AIM_PER_TOKEN_US * n for us, n in zip(t.us, t.sizes))
            cols = f"{aim:>8.1f}{100 * within / len(t.us):>7.1f}%{'-':>10}"
            ok = "yes" if qs[49] <= aim else "NO"
        else:
            cols = f"{'-':>8}{'-':>8}{sum(t.us) / max(1, sum(t.sizes)):>10.2f}"
            ok = "-"
        print(
            f"{name:<12}{len(t.us):>8}{mean:>10.2f}{qs[49]:>9.2f}{qs[98]:>10.2f}{size:>8.1f}"
            f"{cols}  {ok}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1k and 10k nodes, 5k requests each")
    p.add_argument("--sizes", type=int, nargs="*", help="tree sizes in nodes")
    p.add_argument("--requests", type=int, help="timed requests per size (2 ops each + evictions)")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--state-eviction-policy", choices=sorted(STATE_POLICIES), default="lru", dest="policy"
    )
    args = p.parse_args(argv)
    sizes = args.sizes or ([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000])
    requests = args.requests or (5_000 if args.quick else 50_000)
    print(
        f"bench_radix: page_size {args.page_size}, seed {args.seed}, policy {args.policy}, "
        f"python {sys.version.split()[0]}"
    )
    for nodes in sizes:
        bench = Bench(nodes, args.page_size, args.seed, args.policy)
        with tqdm(total=nodes, desc=f"fill {nodes} nodes", leave=False) as bar:
            for _ in range(8 * nodes):
                if bench.tree.num_nodes() >= nodes:
                    break
                before = bench.tree.num_nodes()
                bench.request(timed=False)
                bar.update(max(0, bench.tree.num_nodes() - before))
        bench.kv_budget = bench.tree.total_kv()
        bench.state_budget = bench.tree.total_state()
        t0 = time.perf_counter()
        for _ in tqdm(range(requests), desc=f"replay {nodes} nodes", leave=False):
            bench.request(timed=True)
        report(nodes, bench, requests, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
