"""The hit-rate contract of design.md section 10, asserted on cached_tokens, both strategies,
on the default backend and on one that can write a state inside a prefill forward only every 64
tokens (``strided_backend``: the planner must end forwards at the other snapshots; the backend
raises if asked for one off its stride). Every output is checked against the fake model's
closed form (ids and logprobs), a reference that shares nothing with the engine's path."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, fake_engine, rand_tokens
from fake_model import expected_greedy
from strided_backend import strided_backend

from mambaradix.cache.evict_policy import STATE_POLICIES

STRATEGIES = ["no_buffer", "extra_buffer"]
ALIGN = 64
STRIDE = 64  # the strided backend's snapshot_stride (the chunk of a chunked GPU kernel)


@pytest.fixture(params=["auto", "strided"])
def backend(request):
    """The ``kernel_backend`` of every engine in the test; for the strided one, afterwards:
    nothing was asked off its stride."""
    if request.param == "auto":
        yield "auto"
        return
    with strided_backend(STRIDE) as (name, counts):
        yield name
    assert counts.refused == []


def engine(backend: str, **flags):
    return fake_engine(kernel_backend=backend, **flags)


def generate(eng, prompts, **params) -> list[dict] | dict:
    """``eng.generate`` (greedy), every output checked against the closed form."""
    params = {**GREEDY, **params, "return_logprob": True}
    res = eng.generate(input_ids=prompts, sampling_params=params)
    one = isinstance(prompts[0], int)
    for prompt, r in zip([prompts] if one else prompts, [res] if one else res):
        ids, lps = expected_greedy(prompt, len(r["output_ids"]))
        assert r["output_ids"] == ids, "output differs from the closed form"
        got = r["meta_info"]["output_token_logprobs"]
        assert max((abs(a - b) for a, b in zip(got, lps)), default=0.0) <= 1e-5
    return res


def cached(res: dict) -> int:
    return res["meta_info"]["cached_tokens"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_arriving_together(backend, strategy, rng):
    system = rand_tokens(rng, 300)
    prompts = [system + rand_tokens(rng, rng.randrange(10, 90)) for _ in range(16)]
    with engine(backend, mamba_scheduler_strategy=strategy) as eng:
        res = generate(eng, prompts)
        hits = [cached(r) for r in res]
        eng.check_integrity()
    assert sorted(hits)[0] == 0 and sum(h == 0 for h in hits) == 1, hits
    assert all(h >= 300 // ALIGN * ALIGN for h in hits if h), hits
    # The shared prompt was computed once: 15 of 16 requests skipped 256 tokens each.
    assert eng.stats().cached_tokens >= 15 * 256


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_groups_together_each_computed_once(backend, strategy, rng):
    groups = [rand_tokens(rng, 200), rand_tokens(rng, 330)]
    prompts = [groups[i % 2] + rand_tokens(rng, 20) for i in range(12)]
    with engine(backend, mamba_scheduler_strategy=strategy) as eng:
        res = generate(eng, prompts)
    hits = [cached(r) for r in res]
    assert hits[0] == 0 and hits[1] == 0
    assert all(h >= (len(groups[i % 2]) // ALIGN) * ALIGN for i, h in enumerate(hits) if i > 1)


def _groups_in_a_small_pool(backend, strategy, slots, rng, **pools):
    """Four groups of six requests (a 256-token system prompt each) arriving together into a
    state pool of ``slots``: the cached tokens per request, and the prompt tokens computed
    beyond them (0: nothing computed twice)."""
    systems = [rand_tokens(rng, 256) for _ in range(4)]
    prompts = [s + rand_tokens(rng, rng.randrange(10, 40)) for s in systems for _ in range(6)]
    flags = dict(mamba_scheduler_strategy=strategy, max_mamba_cache_size=slots, **pools)
    with engine(backend, **flags) as eng:
        res = generate(eng, prompts, max_new_tokens=8, ignore_eos=True)
        eng.check_integrity()
        hits = [cached(r) for r in res]
        extra = eng.stats().computed_prefill_tokens - sum(map(len, prompts)) + sum(hits)
        return hits, extra


@pytest.mark.parametrize("policy", STATE_POLICIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("slots", [8, 12, 16])
def test_groups_together_in_a_small_state_pool(backend, strategy, slots, policy, rng):
    """With few state slots, each group's shared snapshot is pinned by the requests waiting for
    it: the snapshots of the requests running meanwhile (repeat points, finishes) are evicted
    first, and no admission evicts it while running requests can free slots instead (both
    state eviction policies: the tiers are the same)."""
    hits, extra = _groups_in_a_small_pool(
        backend, strategy, slots, rng, state_eviction_policy=policy
    )
    for g in range(4):
        group = hits[6 * g : 6 * g + 6]
        assert sum(h == 0 for h in group) == 1 and all(h in (0, 256) for h in group), hits
    assert extra == 0


def test_groups_together_in_a_small_state_pool_without_pins(backend, rng, monkeypatch):
    """Negative control: with the pins off, the same burst recomputes shared prompts
    (no_buffer, 8 slots; under extra_buffer the branch tier alone keeps these prompts)."""
    import mambaradix.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "pin_waiters", lambda *args: None)
    hits, _ = _groups_in_a_small_pool(backend, "no_buffer", 8, rng)
    assert sum(h == 0 for h in hits) > 4, hits


def test_admission_evicting_pinned_states_loses_hits(backend, rng, monkeypatch):
    """Negative control of the admission rule: an admission that may evict pinned states
    while others run (no_buffer, 8 slots: up to 6 running, 4 pinned prompts) trades a
    group's shared prompt for one more running request."""
    from mambaradix.cache.request_cache import RequestCache

    admit = RequestCache.admit
    monkeypatch.setattr(RequestCache, "admit", lambda self, m, n, spare=0: admit(self, m, n))
    hits, _ = _groups_in_a_small_pool(backend, "no_buffer", 8, rng)
    assert sum(h == 0 for h in hits) > 4, hits


@pytest.mark.parametrize("policy", STATE_POLICIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_groups_together_in_a_small_kv_pool(backend, strategy, policy, rng):
    """KV pressure too (1,000 KV slots for 24 prompts of ~280 tokens: decodes retract requests):
    the prefix of a state that waiting requests pinned is the KV evicted last, so each group
    still misses once."""
    hits, _ = _groups_in_a_small_pool(
        backend, strategy, 48, rng, max_total_tokens=1000, state_eviction_policy=policy
    )
    assert sum(h == 0 for h in hits) == 4 and all(h in (0, 256) for h in hits), hits


def test_kv_eviction_ignoring_pins_loses_hits(backend, rng, monkeypatch):
    """Negative control: KV eviction that takes pinned prefixes by age alone (the admission's
    spare ignored) loses a group's shared prompt in the same burst (no_buffer)."""
    from mambaradix.cache.radix import RadixTree

    evict_kv = RadixTree.evict_kv
    monkeypatch.setattr(RadixTree, "evict_kv", lambda self, n, spare=0: evict_kv(self, n))
    hits, _ = _groups_in_a_small_pool(backend, "no_buffer", 48, rng, max_total_tokens=1000)
    assert sum(h == 0 for h in hits) > 4, hits


def _groups_in_turn(backend, strategy, slots, rng, policy: str = "lru") -> list[int]:
    """Four groups (a 256-token system prompt each) taking turns, one request at a time, six
    rounds, into a state pool of ``slots``: the cached tokens from the third round on."""
    systems = [rand_tokens(rng, 256) for _ in range(4)]
    flags = dict(max_mamba_cache_size=slots, state_eviction_policy=policy)
    with engine(backend, mamba_scheduler_strategy=strategy, **flags) as eng:
        hits = [
            cached(generate(eng, s + rand_tokens(rng, rng.randrange(10, 40)), ignore_eos=True))
            for _ in range(6)
            for s in systems
        ]
        eng.check_integrity()
    return hits[8:]


@pytest.mark.parametrize("policy", STATE_POLICIES)
@pytest.mark.parametrize("strategy,slots", [("no_buffer", 8), ("extra_buffer", 12)])
def test_groups_in_turn_in_a_small_state_pool(backend, strategy, slots, policy, rng):
    """Each request's own snapshots (its exact-repeat point, its finish) are newer than its
    group's branch point (and deeper: ``value`` alone would keep them too); least-recently-used
    alone freed the branch points first. Branch points go after them, so from the third round
    on every request hits its prompt."""
    assert all(h >= 256 for h in _groups_in_turn(backend, strategy, slots, rng, policy))


def test_groups_in_turn_without_branch_points(backend, rng, monkeypatch):
    """Negative control: with no state marked a branch point the same turns miss."""
    from mambaradix.cache.radix import RadixTree

    monkeypatch.setattr(RadixTree, "mark_branch", lambda self, node: None)
    hits = _groups_in_turn(backend, "extra_buffer", 12, rng)
    assert sum(h == 0 for h in hits) > 8, hits


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shared_prefix_one_after_another(backend, strategy, rng):
    system = rand_tokens(rng, 300)
    with engine(backend, mamba_scheduler_strategy=strategy) as eng:
        hits = [cached(generate(eng, system + rand_tokens(rng, 40))) for _ in range(6)]
    assert hits[0] == 0
    assert all(h >= 256 for h in hits[2:]), hits


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("length", [100, 129, 300])
def test_exact_repeat(backend, strategy, length, rng):
    prompt = rand_tokens(rng, length)
    with engine(backend, mamba_scheduler_strategy=strategy) as eng:
        first = generate(eng, prompt)
        again = [generate(eng, prompt) for _ in range(2)]
    assert cached(first) == 0
    for r in again:
        assert cached(r) >= (length - 1) // ALIGN * ALIGN
        assert r["output_ids"] == first["output_ids"]
    if strategy == "extra_buffer":  # the goal: exactly L - 1 (tracking slot inside the forward)
        assert all(cached(r) == length - 1 for r in again)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overlap", [True, False])
def test_next_chat_turn(backend, strategy, overlap, rng):
    prompt = rand_tokens(rng, 150)
    with engine(
        backend, mamba_scheduler_strategy=strategy, disable_overlap_schedule=not overlap
    ) as eng:
        for _turn in range(4):
            r = generate(eng, prompt, max_new_tokens=7)
            history = prompt + r["output_ids"]
            prompt = history + rand_tokens(rng, 30)
            nxt = generate(eng, prompt)
            assert cached(nxt) >= len(history) - 1
            prompt = prompt + nxt["output_ids"] + rand_tokens(rng, 20)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_sharing_hits_nothing(backend, strategy, rng):
    prompts = [[i + 1] + rand_tokens(rng, 120) for i in range(20)]  # distinct first tokens
    with engine(backend, mamba_scheduler_strategy=strategy) as eng:
        res = generate(eng, prompts)
    assert [cached(r) for r in res] == [0] * 20


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_worked_example(backend, strategy, rng):
    """design.md section 11: sequential requests over runs A..E of 256 tokens."""
    a, b, c, d, e = (rand_tokens(rng, 256) for _ in range(5))
    seq = [a + b, a + c, a + d, a + b + e, a + d + e, a + c + e, a + c, a + c]
    want = [0, 0, 256, 512, 512, 512, 448, 448]
    with engine(backend, mamba_scheduler_strategy=strategy) as eng:
        got = [cached(generate(eng, p, max_new_tokens=1)) for p in seq]
    assert all(g >= w for g, w in zip(got, want)), (got, want)


def test_cache_disabled_never_hits(backend, rng):
    prompt = rand_tokens(rng, 200)
    with engine(backend, disable_radix_cache=True) as eng:
        res = [generate(eng, prompt) for _ in range(3)]
        eng.check_integrity()
    assert [cached(r) for r in res] == [0, 0, 0]
    assert res[0]["output_ids"] == res[1]["output_ids"] == res[2]["output_ids"]


@pytest.mark.parametrize("overlap", [True, False])
def test_paged_next_chat_turn_and_repeat(backend, overlap, rng):
    """With pages of 16 the tree keeps whole pages; extra_buffer still resumes the next turn at
    the last page boundary (a tracking slot follows decode page by page) and an exact repeat at
    align_down(L - 1, 16)."""
    prompt = rand_tokens(rng, 150)
    with engine(backend, page_size=16, disable_overlap_schedule=not overlap) as eng:
        for _turn in range(4):
            n_out = rng.randrange(5, 40)
            r = generate(eng, prompt, max_new_tokens=n_out, ignore_eos=True)
            again = generate(eng, prompt)
            assert cached(again) >= (len(prompt) - 1) // 16 * 16
            history = prompt + r["output_ids"]
            prompt = history + rand_tokens(rng, 30)
            nxt = generate(eng, prompt)
            assert cached(nxt) >= (len(history) - 1) // 16 * 16
            prompt = prompt + nxt["output_ids"] + rand_tokens(rng, 20)
