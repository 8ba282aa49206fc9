"""Fault isolation: a fault while handling one request fails that request alone (its slots
freed, the integrity check passing, the other requests' outputs unchanged); a fault of the
engine itself marks it dead: every running request gets an error event and every later call
raises at once (none hangs)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from engine_helpers import fake_engine, rand_tokens
from fake_model import FakeModel

from mambaradix.core import SamplingParams
from mambaradix.engine import runner as runner_mod
from mambaradix.engine.engine import Engine
from mambaradix.engine.loop import AddRequests
from mambaradix.engine.outputs import EngineDeadError, RequestError

N_OTHERS = 20


class CharTokenizer:
    """Enough of a tokenizer for the detokenizer: one letter per id."""

    clean_up_tokenization_spaces = True

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _engine() -> Engine:
    """The fake model with a tokenizer (so the detokenizer and stop strings run)."""
    return Engine(
        model=FakeModel(),
        tokenizer=CharTokenizer(),
        debug_integrity=True,
        max_total_tokens=32768,
        max_mamba_cache_size=256,
    )


def _others(rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    """20 requests: greedy ones and seeded sampled ones (whose outputs depend on their random
    generators being left exactly as a batch without the fault would leave them)."""
    prompts = [rand_tokens(rng, rng.randrange(8, 60)) for _ in range(N_OTHERS)]
    params = []
    for i in range(N_OTHERS):
        sampled = i % 3 == 0
        params.append(
            SamplingParams(
                max_new_tokens=12,
                temperature=5.0 if sampled else 0.0,
                seed=100 + i if sampled else None,
                ignore_eos=True,
            )
        )
    return prompts, params


def _run(eng, prompts, params, bad=None):
    """Submit the others with ``bad`` (prompt, params) in the middle of the burst; returns the
    others' results and the bad request's handle."""
    ids = list(prompts)
    ps = [SamplingParams(**{f: getattr(p, f) for f in p.__slots__}) for p in params]
    if bad is not None:
        ids.insert(N_OTHERS // 2, bad[0])
        ps.insert(N_OTHERS // 2, bad[1])
    handles = eng.submit_many(ids, ps)
    bad_handle = handles.pop(N_OTHERS // 2) if bad is not None else None
    return [h.result()["output_ids"] for h in handles], bad_handle


@pytest.fixture(scope="module")
def baseline():
    rng = random.Random(77)
    prompts, params = _others(rng)
    with _engine() as eng:
        outs, _ = _run(eng, prompts, params)
    return prompts, params, outs


def _assert_failed_alone(eng, bad_handle, outs, want, match):
    with pytest.raises(RequestError, match=match):
        bad_handle.result()
    assert outs == want  # the others: the same outputs as without the faulty request
    eng.check_integrity()  # its slots were freed
    assert eng.health().ok
    again = eng.generate(input_ids=[3, 4, 5], sampling_params={"max_new_tokens": 3})
    assert len(again["output_ids"]) == 3  # and the engine keeps serving


def test_seed_out_of_range_is_refused_at_submit() -> None:
    with fake_engine() as eng:
        for seed in (1 << 64, 1 << 63, -1):
            with pytest.raises(ValueError, match="seed"):
                eng.submit([1, 2, 3], SamplingParams(seed=seed, max_new_tokens=2))
        eng.submit([1, 2, 3], SamplingParams(seed=(1 << 63) - 1, max_new_tokens=2)).result()


def test_seed_overflow_that_slips_past_validation_fails_alone(baseline) -> None:
    prompts, params, want = baseline
    with _engine() as eng:
        bad_params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)
        req, handle = eng._make_req([9, 9, 9], bad_params, "bad")
        bad_params.seed = 18446744073709551616  # changed after validation
        eng.loop.put(AddRequests([req]))
        outs, _ = _run(eng, prompts, params)
        _assert_failed_alone(eng, handle, outs, want, "Overflow|seed")


def test_sampler_raising_for_one_request_fails_it_alone(baseline, monkeypatch) -> None:
    prompts, params, want = baseline
    bad = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    real = runner_mod.sample

    def sample(logits, ps, gens, states=None, constrain=None):
        out = real(
            logits, ps, gens, states, constrain
        )  # the other rows' generators have advanced by now
        if any(p is bad for p in ps):
            raise RuntimeError("injected sampler fault")
        return out

    monkeypatch.setattr(runner_mod, "sample", sample)
    with _engine() as eng:
        outs, handle = _run(eng, prompts, params, bad=([4, 5, 6, 7], bad))
        _assert_failed_alone(eng, handle, outs, want, "injected sampler fault")


@pytest.mark.parametrize("where", ["step", "flush"])
def test_detokenizer_raising_for_one_request_fails_it_alone(baseline, where) -> None:
    prompts, params, want = baseline
    bad = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with _engine() as eng:
        detok = eng.outputs.detok
        real = getattr(detok, where)

        def patched(state, ids):
            if state is bad_state[0]:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
            return real(state, ids)

        req, handle = eng._make_req([8, 7, 6, 5], bad, "bad-detok")
        bad_state = [req.detok]
        setattr(detok, where, patched)
        eng.loop.put(AddRequests([req]))
        outs, _ = _run(eng, prompts, params)
        _assert_failed_alone(eng, handle, outs, want, "injected detokenizer fault")


def test_stop_string_fault_fails_alone(baseline, monkeypatch) -> None:
    from mambaradix.engine import output_stage as engine_mod

    prompts, params, want = baseline
    real = engine_mod.find_stop

    def find_stop(text, stops, start):
        if "BOOM" in stops:
            raise ValueError("injected stop-string fault")
        return real(text, stops, start)

    monkeypatch.setattr(engine_mod, "find_stop", find_stop)
    with _engine() as eng:
        bad = SamplingParams(max_new_tokens=6, temperature=0.0, stop=["BOOM"])
        outs, handle = _run(eng, prompts, params, bad=([2, 2, 2], bad))
        _assert_failed_alone(eng, handle, outs, want, "injected stop-string fault")


def test_forward_fault_kills_the_engine_and_every_later_call_raises(caplog) -> None:
    rng = random.Random(3)
    with fake_engine(max_running_requests=4) as eng:
        model = eng.model
        real = model.forward
        calls = {"n": 0}

        def forward(ctx, *a, **k):
            calls["n"] += 1
            if calls["n"] == 6:
                raise RuntimeError("injected forward fault")
            return real(ctx, *a, **k)

        model.forward = forward
        params = [SamplingParams(max_new_tokens=50, ignore_eos=True) for _ in range(8)]
        handles = eng.submit_many([rand_tokens(rng, 20) for _ in range(8)], params)
        for h in handles:  # running and waiting requests alike end with an error event
            with pytest.raises(EngineDeadError, match="injected forward fault"):
                h.result()
        report = eng.health()
        assert report.status == "dead" and "injected forward fault" in report.detail
        with pytest.raises(EngineDeadError, match="injected forward fault"):
            eng.submit([1, 2], SamplingParams(max_new_tokens=1))
        with pytest.raises(EngineDeadError):
            eng.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
        with pytest.raises(EngineDeadError):
            eng.check_integrity()  # raises at once: the loop that would run it is gone
        with pytest.raises(EngineDeadError):
            eng.is_idle()
    logged = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info]
    assert len(logged) == 1, [r.getMessage() for r in logged]  # logged once, with traceback


def test_calls_after_death_never_hang() -> None:
    with fake_engine() as eng:

        def broken(*a, **k):
            raise RuntimeError("dead")

        eng.model.forward = broken
        with pytest.raises(EngineDeadError):
            eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        # queued behind the loop's back (as a submit racing the death would be): failed at once
        eng._health.error = None  # let _make_req through, as a racing submit would get through
        req, handle = eng._make_req([1, 2], SamplingParams(max_new_tokens=1), "late")
        eng._health.die(RuntimeError("dead"))
        eng.loop.put(AddRequests([req]))
        with pytest.raises(EngineDeadError):
            handle.result()


def test_watchdog_reports_a_stuck_forward() -> None:
    release = threading.Event()
    with fake_engine(watchdog_timeout=0.2) as eng:
        real = eng.model.forward

        def slow(ctx, *a, **k):
            release.wait(120)  # released below once the watchdog was seen
            return real(ctx, *a, **k)

        assert eng.health().ok
        eng.model.forward = slow
        handle = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=2))
        start = time.monotonic()
        while eng.health().status != "stuck":
            assert time.monotonic() - start < 60, "watchdog never fired"
            time.sleep(0.05)
        assert "watchdog-timeout" in eng.health().detail
        release.set()
        eng.model.forward = real
        handle.result()
        assert eng.health().ok  # progress again: healthy again
