"""The hit-rate contract of design.md section 10, asserted on cached_tokens, both strategies."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, fake_engine, rand_tokens

STRATEGIES = ["no_buffer", "extra_buffer"]
ALIGN = 64


def cached(res: dict) -> int:
    return res["meta_info"]["cached_tokens"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_arriving_together(strategy, rng):
    system = rand_tokens(rng, 300)
    prompts = [system + rand_tokens(rng, rng.randrange(10, 90)) for _ in range(16)]
    with fake_engine(mamba_scheduler_strategy=strategy) as eng:
        res = eng.generate(input_ids=prompts, sampling_params=GREEDY)
        hits = [cached(r) for r in res]
        eng.check_integrity()
    assert sorted(hits)[0] == 0 and sum(h == 0 for h in hits) == 1, hits
    assert all(h >= 300 // ALIGN * ALIGN for h in hits if h), hits
    # The shared prompt was computed once: 15 of 16 requests skipped 256 tokens each.
    assert eng.stats().cached_tokens >= 15 * 256


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_groups_together_each_computed_once(strategy, rng):
    groups = [rand_tokens(rng, 200), rand_tokens(rng, 330)]
    prompts = [groups[i % 2] + rand_tokens(rng, 20) for i in range(12)]
    with fake_engine(mamba_scheduler_strategy=strategy) as eng:
        res = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    hits = [cached(r) for r in res]
    assert hits[0] == 0 and hits[1] == 0
    assert all(h >= (len(groups[i % 2]) // ALIGN) * ALIGN for i, h in enumerate(hits) if i > 1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_one_after_another(strategy, rng):
    system = rand_tokens(rng, 300)
    with fake_engine(mamba_scheduler_strategy=strategy) as eng:
        hits = [
            cached(eng.generate(input_ids=system + rand_tokens(rng, 40), sampling_params=GREEDY))
            for _ in range(6)
        ]
    assert hits[0] == 0
    assert all(h >= 256 for h in hits[2:]), hits


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("length", [100, 129, 300])
def test_exact_repeat(strategy, length, rng):
    prompt = rand_tokens(rng, length)
    with fake_engine(mamba_scheduler_strategy=strategy) as eng:
        first = eng.generate(input_ids=prompt, sampling_params=GREEDY)
        again = [eng.generate(input_ids=prompt, sampling_params=GREEDY) for _ in range(2)]
    assert cached(first) == 0
    for r in again:
        assert cached(r) >= (length - 1) // ALIGN * ALIGN
        assert r["output_ids"] == first["output_ids"]
    if strategy == "extra_buffer":  # the goal: exactly L - 1 (tracking slot inside the forward)
        assert all(cached(r) == length - 1 for r in again)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overlap", [True, False])
def test_next_chat_turn(strategy, overlap, rng):
    prompt = rand_tokens(rng, 150)
    with fake_engine(
        mamba_scheduler_strategy=strategy, disable_overlap_schedule=not overlap
    ) as eng:
        for _turn in range(4):
            r = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 7})
            history = prompt + r["output_ids"]
            prompt = history + rand_tokens(rng, 30)
            nxt = eng.generate(input_ids=prompt, sampling_params=GREEDY)
            assert cached(nxt) >= len(history) - 1
            prompt = prompt + nxt["output_ids"] + rand_tokens(rng, 20)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sharing_hits_nothing(strategy, rng):
    prompts = [[i + 1] + rand_tokens(rng, 120) for i in range(20)]  # distinct first tokens
    with fake_engine(mamba_scheduler_strategy=strategy) as eng:
        res = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [cached(r) for r in res] == [0] * 20


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_worked_example(strategy, rng):
    """design.md section 11: sequential requests over runs A..E of 256 tokens."""
    a, b, c, d, e = (rand_tokens(rng, 256) for _ in range(5))
    seq = [a + b, a + c, a + d, a + b + e, a + d + e, a + c + e, a + c, a + c]
    want = [0, 0, 256, 512, 512, 512, 448, 448]
    with fake_engine(mamba_scheduler_strategy=strategy) as eng:
        got = [
            cached(eng.generate(input_ids=p, sampling_params={**GREEDY, "max_new_tokens": 1}))
            for p in seq
        ]
    assert all(g >= w for g, w in zip(got, want)), (got, want)


def test_cache_disabled_never_hits(rng):
    prompt = rand_tokens(rng, 200)
    with fake_engine(disable_radix_cache=True) as eng:
        res = [eng.generate(input_ids=prompt, sampling_params=GREEDY) for _ in range(3)]
        eng.check_integrity()
    assert [cached(r) for r in res] == [0, 0, 0]
    assert res[0]["output_ids"] == res[1]["output_ids"] == res[2]["output_ids"]


@pytest.mark.parametrize("overlap", [True, False])
def test_paged_next_chat_turn_and_repeat(overlap, rng):
    """With pages of 16 the tree keeps whole pages; extra_buffer still resumes the next turn at
    the last page boundary (a tracking slot follows decode page by page) and an exact repeat at
    align_down(L - 1, 16)."""
    prompt = rand_tokens(rng, 150)
    with fake_engine(page_size=16, disable_overlap_schedule=not overlap) as eng:
        for _turn in range(4):
            n_out = rng.randrange(5, 40)
            r = eng.generate(
                input_ids=prompt,
                sampling_params={**GREEDY, "max_new_tokens": n_out, "ignore_eos": True},
            )
            again = eng.generate(input_ids=prompt, sampling_params=GREEDY)
            assert cached(again) >= (len(prompt) - 1) // 16 * 16
            history = prompt + r["output_ids"]
            prompt = history + rand_tokens(rng, 30)
            nxt = eng.generate(input_ids=prompt, sampling_params=GREEDY)
            assert cached(nxt) >= (len(history) - 1) // 16 * 16
            prompt = prompt + nxt["output_ids"] + rand_tokens(rng, 20)
