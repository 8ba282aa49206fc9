"""Paths the contract tests did not reach: retraction with pages and the retracted request's
resume from its own snapshots, --mamba-track-interval, abort while a no_buffer snapshot copy is
in flight, prompts longer than the chunk size and --max-prefill-tokens, no_buffer hits with
pages. Outputs are checked against the fake model's closed form (``expected_greedy``)."""

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
from fake_model import expected_greedy

STRATEGIES = ["no_buffer", "extra_buffer"]


def record_admissions(sched) -> list[int]:
    """Wrap the cache's admit: the prefix each admission resumes from, in order."""
    prefixes: list[int] = []
    admit = sched.cache.admit

    def recording(match, first_len, *args, **kw):
        got = admit(match, first_len, *args, **kw)
        if got is not None:
            prefixes.append(match.prefix_len)
        return got

    sched.cache.admit = recording
    return prefixes


def retraction_run(strategy: str, page: int, interval: int):
    """Two long decodes and one short request in a KV pool too small for all: the newest
    running request is retracted at ~224 tokens; its snapshots every ``interval`` decode
    tokens stay in the tree, and the other request's growth evicts only the newest of them."""
    rng = random.Random(0)
    sched = make_scheduler(
        mamba_scheduler_strategy=strategy,
        page_size=page,
        max_total_tokens=448,
        mamba_track_interval=interval,
    )
    reqs = [
        new_req(f"r{i}", rand_tokens(rng, n), m, ignore_eos=True)
        for i, (n, m) in enumerate([(40, 200), (40, 200), (150, 60)])
    ]
    for r in reqs:
        sched.add(r)
    prefixes = record_admissions(sched)
    run_to_end(sched)
    return sched, reqs, prefixes


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("page", [1, 16])
def test_retracted_request_resumes_from_its_own_snapshot(strategy, page):
    sched, reqs, prefixes = retraction_run(strategy, page, interval=32)
    assert sched.stats.retractions >= 1
    # the prompts share nothing, so a resume can only come from the request's own snapshots
    assert len(prefixes) == 3 + sched.stats.retractions
    assert max(prefixes[3:]) >= 192, prefixes  # a decode snapshot past its 40-token prompt
    for r in reqs:
        assert r.output_ids == expected_greedy(r.prompt_ids, r.params.max_new_tokens)[0], r.rid
    assert_all_free(sched)


def test_retraction_without_decode_snapshots_resumes_short():
    """Negative control: with snapshots every 256 decode tokens the retracted request finds
    at most its prompt's, so the >= 192 above comes from --mamba-track-interval."""
    sched, reqs, prefixes = retraction_run("extra_buffer", 16, interval=256)
    assert sched.stats.retractions >= 1
    assert max(prefixes[3:]) < 64, prefixes
    for r in reqs:
        assert r.output_ids == expected_greedy(r.prompt_ids, r.params.max_new_tokens)[0]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("interval", [32, 48])
def test_track_interval_snapshots_during_decode(strategy, interval, rng):
    prompt = rand_tokens(rng, 40)
    with fake_engine(mamba_scheduler_strategy=strategy, mamba_track_interval=interval) as eng:
        first = eng.generate(
            input_ids=prompt,
            sampling_params={**GREEDY, "max_new_tokens": 200, "ignore_eos": True},
        )
        history = prompt + first["output_ids"]
        for cut in (100, 170, 201):
            later = history[:cut] + rand_tokens(rng, 5)
            got = eng.generate(input_ids=later, sampling_params={**GREEDY, "ignore_eos": True})
            want = cut // interval * interval  # the deepest decode snapshot inside the cut
            assert got["meta_info"]["cached_tokens"] == want, (cut, got["meta_info"])
            assert got["output_ids"] == expected_greedy(later, GREEDY["max_new_tokens"])[0]
        eng.check_integrity()


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_while_a_no_buffer_copy_is_in_flight(overlap, rng):
    """With overlap, the aborted request's snapshot copy runs in the batch in flight and still
    lands in the tree (its KV path is kept): the tree stays consistent, nothing leaks, and a
    later request resumes from that snapshot. Without overlap the abort comes between the
    copy's recording and its batch: the copy is dropped, and nothing leaks either."""
    sched = make_scheduler(
        mamba_scheduler_strategy="no_buffer",
        chunked_prefill_size=64,
        disable_overlap_schedule=not overlap,
    )
    prompt = rand_tokens(rng, 400)
    victim = new_req("victim", prompt, 8, ignore_eos=True)
    sched.add(victim)
    copy_pos = None
    for _ in range(50):
        if not overlap:  # without overlap a batch's copies run inside step(): abort between
            pending = victim.snapshot_plan.copy_at  # recorded for the next batch's start
            if pending is not None:
                sched.abort(victim)
                copy_pos = pending
                break
        sched.step()
        sched.check_integrity()
        if overlap and sched.inflight is not None and sched.inflight[0].copies:
            copy_pos = sched.inflight[0].copies[0][1]
            sched.abort(victim)  # the batch that copies its state is still running
            break
    assert copy_pos is not None and copy_pos % 64 == 0
    run_to_end(sched)
    assert victim.finish_reason.value == "abort" and victim.rc is None
    later = new_req("later", prompt[:copy_pos] + rand_tokens(rng, 10), 4, ignore_eos=True)
    sched.add(later)
    prefixes = record_admissions(sched)
    run_to_end(sched)
    if overlap:
        assert prefixes == [copy_pos]  # resumed from the aborted request's in-flight copy
    else:
        # a copy recorded but not yet scheduled is dropped with the request: the later one
        # resumes from the snapshot before it
        assert prefixes == [copy_pos - 64]
    assert later.output_ids == expected_greedy(later.prompt_ids, 4)[0]
    assert_all_free(sched)


@pytest.mark.parametrize("chunk", [64, -1])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prompts_longer_than_the_chunk_and_the_prefill_budget(chunk, strategy, rng):
    """A 1,000-token prompt beside shorter ones, with chunks of 64 (or none) and a forward
    budget of 100 new tokens: no forward computes more than the budget, no request more than
    a chunk per forward, and every output is the closed form's."""
    sched = make_scheduler(
        mamba_scheduler_strategy=strategy, chunked_prefill_size=chunk, max_prefill_tokens=100
    )
    sizes: list[list[int]] = []
    submit = sched.runner.submit

    def recording(batch):
        sizes.append([len(r.input_ids) for r in batch.forward.reqs])
        return submit(batch)

    sched.runner.submit = recording
    system = rand_tokens(rng, 130)
    reqs = [new_req("long", rand_tokens(rng, 1000), 5, ignore_eos=True)]
    reqs += [
        new_req(f"s{i}", system + rand_tokens(rng, 40 + 30 * i), 5, ignore_eos=True)
        for i in range(4)
    ]
    for r in reqs:
        sched.add(r)
    run_to_end(sched)
    assert max(sum(s) for s in sizes) <= 100
    if chunk > 0:
        assert max(max(s) for s in sizes) <= chunk
    assert sum(1 for s in sizes if s and max(s) > 1) >= 1000 // 100  # the long one was split
    for r in reqs:
        assert r.output_ids == expected_greedy(r.prompt_ids, 5)[0], r.rid
    assert_all_free(sched)


@pytest.mark.parametrize("overlap", [True, False])
def test_no_buffer_hits_with_pages(overlap, rng):
    """no_buffer with pages of 16: shared prefixes arriving together hit align_down(S, 64),
    exact repeats align_down(L - 1, 64), the next chat turn the previous prompt + completion
    rounded down to the alignment; outputs are the closed form's throughout."""
    flags = dict(mamba_scheduler_strategy="no_buffer", page_size=16)
    ONE = {**GREEDY, "ignore_eos": True}  # noqa: N806
    system = rand_tokens(rng, 300)
    burst = [system + rand_tokens(rng, rng.randrange(10, 60)) for _ in range(8)]
    with fake_engine(disable_overlap_schedule=not overlap, **flags) as eng:
        res = eng.generate(input_ids=burst, sampling_params=ONE)
        hits = sorted(r["meta_info"]["cached_tokens"] for r in res)
        assert hits[0] == 0 and all(h >= 256 for h in hits[1:]), hits
        for p, r in zip(burst, res):
            assert r["output_ids"] == expected_greedy(p, 4)[0]
        prompt = rand_tokens(rng, 150)
        for _turn in range(3):
            r = eng.generate(
                input_ids=prompt,
                sampling_params={**GREEDY, "max_new_tokens": 9, "ignore_eos": True},
            )
            again = eng.generate(input_ids=prompt, sampling_params=ONE)
            assert again["meta_info"]["cached_tokens"] >= (len(prompt) - 1) // 64 * 64
            history = prompt + r["output_ids"]
            prompt = history + rand_tokens(rng, 30)
            nxt = eng.generate(input_ids=prompt, sampling_params=ONE)
            assert nxt["meta_info"]["cached_tokens"] >= (len(history) - 1) // 64 * 64
            assert nxt["output_ids"] == expected_greedy(prompt, 4)[0]
            prompt = prompt + nxt["output_ids"] + rand_tokens(rng, 20)
        eng.check_integrity()
