"""Scheduler lifecycle on the fake model: aborts, pressure, copies, deferred ops, chunking."""

from __future__ import annotations

import random

import pytest
from engine_helpers import (
    GREEDY,
    assert_all_free,
    fake_engine,
    make_scheduler,
    new_req,
    rand_tokens,
    run_to_end,
)

from mambaradix.core import SamplingParams
from mambaradix.engine.request import ReqStatus

STRATEGIES = ["no_buffer", "extra_buffer"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overlap", [True, False])
def test_abort_in_queue_mid_prefill_mid_decode_leaks_nothing(strategy, overlap, rng):
    sched = make_scheduler(
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        chunked_prefill_size=64,
        max_running_requests=2,
    )
    system = rand_tokens(rng, 200)
    prefill = new_req("prefill", system + rand_tokens(rng, 300), n=20, ignore_eos=True)
    decode = new_req("decode", rand_tokens(rng, 70), n=50, ignore_eos=True)
    queued = new_req("queued", system + rand_tokens(rng, 10))
    survivor = new_req("survivor", system + rand_tokens(rng, 30))
    for r in (decode, prefill, queued, survivor):
        sched.add(r)
    aborted_at = {}
    for _ in range(200):
        sched.step()
        sched.check_integrity()
        if "queued" not in aborted_at and queued.status is ReqStatus.WAITING:
            sched.abort(queued)
            aborted_at["queued"] = queued.fed_len
        if "prefill" not in aborted_at and 0 < prefill.fed_len < len(prefill.prompt_ids):
            sched.abort(prefill)
            aborted_at["prefill"] = prefill.fed_len
        if "decode" not in aborted_at and len(decode.output_ids) >= 3:
            sched.abort(decode)
            aborted_at["decode"] = len(decode.output_ids)
        if sched.is_idle():
            break
    run_to_end(sched)
    assert set(aborted_at) == {"queued", "prefill", "decode"}
    assert aborted_at["queued"] == 0 and 0 < aborted_at["prefill"]
    for r in (queued, prefill, decode):
        assert r.finish_reason.value == "abort" and r.rc is None
    assert survivor.finish_reason.value in ("stop", "length") and survivor.output_ids
    assert_all_free(sched)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_copies_per_strategy(strategy, rng):
    """extra_buffer caches without any copy; no_buffer copies exactly once per snapshot."""
    sched = make_scheduler(mamba_scheduler_strategy=strategy, chunked_prefill_size=128)
    system = rand_tokens(rng, 300)
    for i in range(10):
        sched.add(new_req(f"r{i}", system + rand_tokens(rng, 50 + i), n=6, ignore_eos=True))
    run_to_end(sched)
    st, pool = sched.stats, sched.cache.state_pool
    assert st.resumes > 0 and st.snapshots_inserted > 0
    if strategy == "extra_buffer":
        assert pool.copies == st.resumes  # only resumes copy; caching donates slots
        assert st.snapshot_copies == 0
    else:
        assert pool.copies == st.resumes + st.snapshot_copies
        assert st.snapshot_attempts == st.snapshot_copies  # one copy per snapshot taken
    assert_all_free(sched)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deferred_ops_run_before_the_forward(strategy, rng):
    """A resume copy is recorded by the scheduler and executed by the runner: dropping the
    batch's state ops (negative control) changes the outputs of resumed requests."""
    prompt_a = rand_tokens(rng, 200)
    outs = {}
    for drop in (False, True):
        sched = make_scheduler(mamba_scheduler_strategy=strategy, disable_overlap_schedule=True)
        if drop:
            run = sched.runner.run

            def run_without_ops(batch, run=run):
                if batch.batch_id > 3:
                    batch.forward.state_ops.copy_src.clear()
                    batch.forward.state_ops.copy_dst.clear()
                return run(batch)

            sched.runner.run = run_without_ops
        reqs = [new_req(f"r{i}", prompt_a + [i + 1] * 5, n=8, ignore_eos=True) for i in range(3)]
        for r in reqs:
            sched.add(r)
            run_to_end(sched)
        outs[drop] = [r.output_ids for r in reqs]
        assert reqs[2].cached_tokens > 0
    assert outs[False][0] == outs[True][0]
    assert outs[False][2] != outs[True][2]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overlap", [True, False])
def test_pressure_more_requests_than_slots(strategy, overlap):
    rng = random.Random(7)
    systems = [rand_tokens(rng, 120) for _ in range(4)]
    prompts = [systems[i % 4] + rand_tokens(rng, rng.randrange(20, 120)) for i in range(80)]
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    with fake_engine(max_total_tokens=1 << 15, disable_overlap_schedule=True) as ref:
        want = [r["output_ids"] for r in ref.generate(input_ids=prompts, sampling_params=params)]
    with fake_engine(
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        max_mamba_cache_size=8,  # 80 concurrent requests, 8 state slots
        max_total_tokens=448,  # below what even two of them need at once
        chunked_prefill_size=64,
    ) as eng:
        got = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)]
        stats = eng.stats()
        assert eng.is_idle()
        eng.check_integrity()
        free_all = eng.call(lambda: _evict_all_and_count(eng))
    assert got == want
    assert stats.retractions > 0 and stats.admission_waits > 0
    assert stats.evicted_states > 0 and stats.evicted_kv_tokens > 0
    assert free_all == (eng.kv_pool.size, eng.state_pool.size)


def _evict_all_and_count(eng):
    tree = eng.cache.tree
    tree.evict_kv(eng.kv_pool.size)
    tree.evict_state(eng.state_pool.size)
    eng.cache.check_integrity()
    return eng.kv_pool.available(), eng.state_pool.available()


def test_skipped_snapshot_is_counted_not_fatal(rng):
    """With one spare state slot, snapshots that cannot get a slot are skipped and counted."""
    sched = make_scheduler(
        mamba_scheduler_strategy="no_buffer", max_mamba_cache_size=3, max_running_requests=3
    )
    system = rand_tokens(rng, 300)
    reqs = [new_req(f"r{i}", system + rand_tokens(rng, 40), n=3) for i in range(6)]
    for r in reqs:
        sched.add(r)
    run_to_end(sched)
    assert sched.stats.skipped_snapshots > 0
    assert all(r.output_ids for r in reqs)
    assert_all_free(sched)


def test_sampling_seeded_and_stop_tokens(rng):
    prompt = rand_tokens(rng, 50)
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 11, "max_new_tokens": 12}
    with fake_engine() as eng:
        a = eng.generate(input_ids=prompt, sampling_params=params)
        b = eng.generate(input_ids=prompt, sampling_params=params)
        greedy = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 12})
        stop_tok = greedy["output_ids"][2]
        stopped = eng.generate(
            input_ids=prompt,
            sampling_params={**GREEDY, "max_new_tokens": 12, "stop_token_ids": [stop_tok]},
        )
        lp = eng.generate(input_ids=prompt, sampling_params={**GREEDY, "return_logprob": True})
    assert a["output_ids"] == b["output_ids"]
    first_stop = greedy["output_ids"].index(stop_tok)
    assert stopped["output_ids"] == greedy["output_ids"][: first_stop + 1]
    assert stopped["meta_info"]["finish_reason"] == "stop"
    assert len(lp["meta_info"]["output_token_logprobs"]) == 4
    assert all(x <= 0 for x in lp["meta_info"]["output_token_logprobs"])


def test_bad_input_is_rejected_and_engine_keeps_serving(rng):
    with fake_engine() as eng:
        for bad in (
            dict(input_ids=[], p={}),
            dict(input_ids=[1, 2, 3], p={"temperature": -1}),
            dict(input_ids=[1, 2, 3], p={"top_p": 0}),
            dict(input_ids=[1, 2, 3], p={"max_new_tokens": 0}),
            dict(input_ids=[1] * 20000, p={}),
            dict(input_ids=[1, 10_000], p={}),
        ):
            with pytest.raises(ValueError):
                eng.submit(bad["input_ids"], SamplingParams(**bad["p"]))
        ok = eng.generate(input_ids=rand_tokens(rng, 10), sampling_params=GREEDY)
    assert len(ok["output_ids"]) >= 1


def test_lpm_under_memory_pressure_leaks_nothing():
    """Longest-prefix-first ordering while admissions evict the tree: same outputs as the
    unpressured reference, and the integrity check holds after every step."""
    rng = random.Random(3)
    systems = [rand_tokens(rng, 100) for _ in range(5)]
    prompts = [systems[i % 5] + rand_tokens(rng, rng.randrange(10, 80)) for i in range(60)]
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    with fake_engine(disable_overlap_schedule=True) as ref:
        want = [r["output_ids"] for r in ref.generate(input_ids=prompts, sampling_params=params)]
    with fake_engine(schedule_policy="lpm", max_mamba_cache_size=12, max_total_tokens=768) as eng:
        got = [r["output_ids"] for r in eng.generate(input_ids=prompts, sampling_params=params)]
        stats = eng.stats()
        eng.check_integrity()
    assert got == want
    assert stats.evicted_kv_tokens > 0 and stats.evicted_states > 0


def test_lpm_admission_rematches_after_an_eviction():
    """Under lpm the queue is ordered by lookups taken before any admission. Admitting W1 evicts
    the node W2 had matched: W2 must be matched again (a stale lookup would lock a deleted node)."""
    sched = make_scheduler(
        schedule_policy="lpm", max_total_tokens=200, disable_overlap_schedule=True
    )
    a, b = [1] * 60, [2] * 100
    for rid, ids in (("a", a), ("b", b)):
        sched.add(new_req(rid, ids, n=1))
        run_to_end(sched)
    assert sched.cache.tree.total_kv() == 160
    w1 = new_req("w1", b + [3] * 50, n=1)
    w2 = new_req("w2", a + [4] * 5, n=1)
    sched.add(w2)
    sched.add(w1)
    run_to_end(sched)
    assert w1.cached_tokens == 100  # ordered first: the longer prefix
    assert w2.cached_tokens == 0  # its prefix was evicted to make room for w1
    assert_all_free(sched)
