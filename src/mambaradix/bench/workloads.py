"""Seeded benchmark workloads (token-id prompts) and the ideal prefix-cache hit rate.

A workload is a list of sessions; a session is a list of turns. Turn k's prompt is
``prompt(k-1) + output(k-1) + turn.new_ids``, so single-turn workloads are sessions of one
turn and the multi-turn workload needs each turn's actual output before sending the next.

- ``generated-shared-prefix`` (SGLang's): ``num_groups`` system prompts, each shared by
  ``prompts_per_group`` requests that append their own question; group-major order, or
  interleaved across groups.
- ``random``: independent random prompts (no sharing beyond chance).
- ``multi-turn``: chat sessions that resend their history (optionally behind one system prompt
  shared by all sessions).

Lengths are drawn uniformly from ``[int(len * range_ratio), len]`` (``range_ratio`` 1 = fixed).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Turn:
    new_ids: list[int]
    output_len: int


@dataclass(slots=True)
class Session:
    turns: list[Turn]


@dataclass(slots=True)
class Workload:
    name: str
    sessions: list[Session] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


class TokenSampler:
    """Seeded random token ids drawn from ``[0, vocab_size)`` minus ``exclude`` (special ids)."""

    def __init__(self, vocab_size: int, seed: int, exclude: set[int] | frozenset = frozenset()):
        allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude, dtype=np.int64))
        if allowed.size == 0:
            raise ValueError(f"no token ids to sample from (vocab_size={vocab_size})")
        self.allowed = allowed
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> list[int]:
        return self.allowed[self.rng.integers(0, self.allowed.size, n)].tolist()

    def length(self, full: int, range_ratio: float, minimum: int = 0) -> int:
        lo = max(minimum, int(full * range_ratio))
        hi = max(lo, full)
        return int(self.rng.integers(lo, hi + 1))


def generated_shared_prefix(
    sampler: TokenSampler,
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    range_ratio: float = 1.0,
    interleave: bool = False,
) -> Workload:
    """Group-major order, or with ``interleave`` the k-th request of every group before the
    (k+1)-th of any (the same token ids either way)."""
    wl = Workload("generated-shared-prefix")
    groups: list[list[Session]] = []
    for _ in range(num_groups):
        system = sampler.tokens(sampler.length(system_prompt_len, range_ratio, minimum=1))
        group = []
        for _ in range(prompts_per_group):
            question = sampler.tokens(sampler.length(question_len, range_ratio))
            out = sampler.length(output_len, range_ratio, minimum=1)
            group.append(Session([Turn(system + question, out)]))
        groups.append(group)
    if interleave:
        wl.sessions = [g[k] for k in range(prompts_per_group) for g in groups]
    else:
        wl.sessions = [s for g in groups for s in g]
    return wl


def random_workload(
    sampler: TokenSampler, num_prompts: int, input_len: int, output_len: int, range_ratio: float
) -> Workload:
    wl = Workload("random")
    for _ in range(num_prompts):
        prompt = sampler.tokens(sampler.length(input_len, range_ratio, minimum=1))
        out = sampler.length(output_len, range_ratio, minimum=1)
        wl.sessions.append(Session([Turn(prompt, out)]))
    return wl


def multi_turn(
    sampler: TokenSampler,
    num_sessions: int,
    num_turns: int,
    system_prompt_len: int,
    user_len: int,
    output_len: int,
    range_ratio: float = 1.0,
) -> Workload:
    wl = Workload("multi-turn")
    system = sampler.tokens(system_prompt_len)
    for _ in range(num_sessions):
        turns = []
        for k in range(num_turns):
            user = sampler.tokens(sampler.length(user_len, range_ratio, minimum=1))
            out = sampler.length(output_len, range_ratio, minimum=1)
            turns.append(Turn((system + user) if k == 0 else user, out))
        wl.sessions.append(Session(turns))
    return wl


# --------------------------------------------------------------------------- ideal hit rate


def align_down(n: int, alignment: int) -> int:
    return n // alignment * alignment


class IdealCache:
    """The most a prefix cache with snapshots at ``alignment`` could hit, request by request.

    Fed requests in issue order. A request with prompt P (length L) can resume at most at
    L - 1 (one token must be computed), from either
      - an aligned position inside its longest common prefix with any earlier sequence
        (branch points and chunk ends are aligned), or
      - exactly the end of an earlier request's cached sequence (prompt + output[:-1], the
        tokens whose KV exists: the finish snapshot), when that sequence is a prefix of P.
    An upper bound: it assumes every branch point is already known when a request arrives.
    """

    def __init__(self, alignment: int) -> None:
        if alignment < 1:
            raise ValueError("alignment must be >= 1")
        self.alignment = alignment
        self._sorted: list[tuple[int, ...]] = []
        self._exact: set[tuple[int, ...]] = set()
        self._lengths: list[int] = []  # sorted distinct lengths in _exact

    def hit(self, prompt: list[int]) -> int:
        """Ideal cached tokens of ``prompt`` given the sequences added so far."""
        limit = len(prompt) - 1
        if limit <= 0 or not self._sorted:
            return 0
        key = tuple(prompt)
        i = bisect.bisect_left(self._sorted, key)
        lcp = 0
        for j in (i - 1, i):
            if 0 <= j < len(self._sorted):
                lcp = max(lcp, _lcp(self._sorted[j], key))
        best = align_down(min(lcp, limit), self.alignment)
        # exact finish points beat the aligned position; longest first
        hi = bisect.bisect_right(self._lengths, min(lcp, limit))
        for n in reversed(self._lengths[:hi]):
            if n <= best:
                break
            if key[:n] in self._exact:
                return n
        return best

    def add(self, prompt: list[int], output: list[int]) -> None:
        """Record a finished request: its KV covers prompt + output[:-1]."""
        seq = tuple(prompt) + tuple(output[:-1])
        if not seq:
            return
        bisect.insort(self._sorted, seq)
        if seq not in self._exact:
            self._exact.add(seq)
            k = bisect.bisect_left(self._lengths, len(seq))
            if k == len(self._lengths) or self._lengths[k] != len(seq):
                self._lengths.insert(k, len(seq))


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def ideal_hits(requests: list[tuple[list[int], list[int]]], alignment: int) -> list[int]:
    """Ideal cached tokens per request; ``requests`` = (prompt, output ids) in issue order."""
    cache = IdealCache(alignment)
    hits = []
    for prompt, output in requests:
        hits.append(cache.hit(prompt))
        cache.add(prompt, output)
    return hits
