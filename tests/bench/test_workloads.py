"""Workload generators (seeded sharing as specified) and the ideal hit rate (no engine)."""

from __future__ import annotations

import pytest

from mambaradix.bench.client import RequestResult
from mambaradix.bench.report import summarize
from mambaradix.bench.workloads import (
    IdealCache,
    TokenSampler,
    generated_shared_prefix,
    ideal_hits,
    multi_turn,
    random_workload,
)


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _prompts(wl) -> list[list[int]]:
    return [s.turns[0].new_ids for s in wl.sessions]


def test_gsp_groups_share_exactly_the_system_prompt() -> None:
    wl = generated_shared_prefix(TokenSampler(1000, seed=3), 3, 4, 100, 20, 8)
    prompts = _prompts(wl)
    assert wl.num_requests == 12 and all(len(p) == 120 for p in prompts)
    assert all(t.output_len == 8 for s in wl.sessions for t in s.turns)
    for i, p in enumerate(prompts):
        for j, q in enumerate(prompts[:i]):
            same_group = i // 4 == j // 4
            if same_group:
                assert p[:100] == q[:100]
            else:  # random 100-token prompts from a vocab of 1000 do not share 100 tokens
                assert _lcp(p, q) < 100


def test_gsp_is_seeded() -> None:
    a = _prompts(generated_shared_prefix(TokenSampler(500, seed=7), 2, 3, 64, 8, 4))
    b = _prompts(generated_shared_prefix(TokenSampler(500, seed=7), 2, 3, 64, 8, 4))
    c = _prompts(generated_shared_prefix(TokenSampler(500, seed=8), 2, 3, 64, 8, 4))
    assert a == b and a != c


def test_range_ratio_bounds_lengths() -> None:
    wl = generated_shared_prefix(TokenSampler(500, seed=1), 5, 5, 100, 40, 10, range_ratio=0.5)
    lens = [len(p) for p in _prompts(wl)]
    assert all(50 + 20 <= n <= 140 for n in lens) and len(set(lens)) > 1
    outs = {t.output_len for s in wl.sessions for t in s.turns}
    assert all(5 <= n <= 10 for n in outs) and len(outs) > 1


def test_sampler_excludes_special_ids() -> None:
    s = TokenSampler(10, seed=0, exclude={0, 9})
    toks = s.tokens(2000)
    assert set(toks) == set(range(1, 9))


def test_ideal_gsp_rate_is_aligned_system_prompt() -> None:
    # 2 groups x 4 prompts, system 200, question 10: every non-first request of a group could
    # resume at align_down(200, 64) = 192
    wl = generated_shared_prefix(TokenSampler(1000, seed=0), 2, 4, 200, 10, 1)
    hits = ideal_hits([(p, [1]) for p in _prompts(wl)], alignment=64)
    assert hits == [0, 192, 192, 192, 0, 192, 192, 192]
    # page-size 256 alignment: the 200-token prefix is not reusable
    assert ideal_hits([(p, [1]) for p in _prompts(wl)], alignment=256) == [0] * 8


def test_ideal_exact_repeat_is_aligned_l_minus_1() -> None:
    p = list(range(1, 130))  # L = 129: limit 128 = 2 * 64
    assert ideal_hits([(p, [5]), (p, [5])], 64) == [0, 128]
    q = list(range(1, 129))  # L = 128: limit 127 -> 64
    assert ideal_hits([(q, [5]), (q, [5])], 64) == [0, 64]


def test_ideal_next_turn_resumes_exactly_at_previous_end() -> None:
    prompt, out = list(range(100)), [900, 901, 902]
    nxt = prompt + out + [7, 8]
    # KV exists for prompt + out[:-1] = 102 tokens (the finish snapshot), unaligned
    assert ideal_hits([(prompt, out), (nxt, [1])], 64) == [0, 102]
    # a diverging next turn only gets the aligned common prefix
    other = prompt[:70] + [5] * 40
    assert ideal_hits([(prompt, out), (other, [1])], 64) == [0, 64]


def test_ideal_cache_matches_brute_force() -> None:
    sampler = TokenSampler(4, seed=11)  # tiny vocab: lots of accidental sharing
    seqs = [(sampler.tokens(sampler.length(150, 0.2, 1)), sampler.tokens(3)) for _ in range(60)]
    cache = IdealCache(8)
    seen: list[list[int]] = []
    for prompt, out in seqs:
        limit = len(prompt) - 1
        brute = 0
        for kv in seen:
            brute = max(brute, min(_lcp(kv, prompt), limit) // 8 * 8)
            if len(kv) <= limit and prompt[: len(kv)] == kv:
                brute = max(brute, len(kv))
        assert cache.hit(prompt) == brute
        cache.add(prompt, out)
        seen.append(prompt + out[:-1])


def test_random_workload_has_no_sharing() -> None:
    wl = random_workload(TokenSampler(32000, seed=2), 20, 300, 4, 1.0)
    hits = ideal_hits([(p, [1]) for p in _prompts(wl)], 64)
    assert wl.num_requests == 20 and hits == [0] * 20


def test_multi_turn_structure() -> None:
    wl = multi_turn(TokenSampler(1000, seed=4), 3, 4, 50, 10, 5)
    assert wl.num_requests == 12
    firsts = [s.turns[0].new_ids for s in wl.sessions]
    assert all(len(f) == 60 and f[:50] == firsts[0][:50] for f in firsts)
    assert all(len(t.new_ids) == 10 for s in wl.sessions for t in s.turns[1:])


def test_summary_hit_rates() -> None:
    p = list(range(1, 130))
    mk = lambda cached, start: RequestResult(  # noqa: E731
        prompt_ids=p, output_ids=[3, 4], prompt_len=len(p), output_len=2,
        cached_tokens=cached, start=start, ttft=0.1, itls=[0.05], latency=0.15, success=True,
    )  # fmt: skip
    s = summarize([mk(0, 0.0), mk(64, 1.0)], duration=2.0, alignment=64)
    assert s["cache_hit_rate"] == pytest.approx(64 / 258)
    assert s["ideal_hit_rate"] == pytest.approx(128 / 258)
    assert s["completed"] == 2 and s["output_throughput"] == pytest.approx(2.0)
    assert s["mean_tpot_ms"] == pytest.approx(50.0)
