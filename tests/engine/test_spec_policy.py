"""``--speculative-adaptive``'s policy (``engine.spec_policy``) on its own: the step-cost
estimates (medians of recent steps, unconfirmed shapes taken at their neighbours' word), the
accept rates, and the cap it settles on against simulated machines whose step
costs and accept rates are known, so the best fixed cap is known too.

The simulations draw each draft token's fate with the given accept rate and each step's time
with +-20% noise (seeded); the policy must reach at least 0.9 of the tokens per second of the
best fixed cap, on a memory-bound machine (drafts almost free: the full draft), a compute-bound
one (rows cost in proportion: no draft), the measured batch-1 shape of Qwen3.5-0.8B on the
AVX2 EPYC (a middle cap), and when the accept rate falls and rises again (the cap follows
both ways: the probes at cap 0 see the rise). A negative control holds the cap fixed at k
where it does not pay and falls short of the bound, so the bound can fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from mambaradix.engine.spec_policy import (
    CONFIRM,
    PROBE_EVERY,
    SAMPLES,
    AcceptRates,
    AdaptiveDrafts,
    StepCosts,
    expected_tokens,
)


@dataclass
class FakeReq:
    spec_rate: tuple[float, float] | None = None


# ------------------------------------------------------------------------------- step costs


def seen(costs, batch: int, rows: int, seconds: float, times: int = CONFIRM) -> None:
    for _ in range(times):
        costs.observe(batch, rows, seconds)


def test_costs_interpolate_and_extend_the_measured_rows():
    c = StepCosts()
    assert c.estimate(1, 2) is None  # nothing measured
    seen(c, 1, 1, 1.0)
    assert c.estimate(1, 1) == 1.0
    assert c.estimate(1, 4) == 1.0  # one point, no slope anywhere: more rows assumed free
    seen(c, 1, 4, 2.5)
    assert c.estimate(1, 2) == pytest.approx(1.5)  # between two measured rows: linear
    seen(c, 1, 3, 1.6)
    assert c.estimate(1, 5) == pytest.approx(2.5 + 0.9)  # beyond: the last segment's slope
    c.observe(1, 4, 10.0)  # one slow step (the machine's load): the median ignores it
    assert c.estimate(1, 4) == pytest.approx(2.5)
    seen(c, 1, 4, 3.0, times=SAMPLES)  # the last SAMPLES steps: the cost moved
    assert c.estimate(1, 4) == pytest.approx(3.0)


def test_an_unconfirmed_shape_is_no_dearer_than_its_neighbours_suggest():
    """The first step of a shape is the Python forward, or the first of its kind in the
    process: until CONFIRM steps of it are in, its cost is at most what the confirmed shapes
    around it give."""
    c = StepCosts()
    seen(c, 1, 1, 1.0)
    seen(c, 1, 3, 2.0)
    c.observe(1, 2, 3.0)  # a first step, 2x its steady cost
    assert not c.confirmed(1, 2)
    assert c.estimate(1, 2) == pytest.approx(1.5)
    c.observe(1, 2, 1.2)
    assert c.estimate(1, 2) == pytest.approx(1.2)  # or its own fastest step, if lower
    c.observe(1, 2, 1.4)
    assert c.confirmed(1, 2) and c.estimate(1, 2) == pytest.approx(1.4)  # the median of 3


def test_costs_of_an_unmeasured_batch_come_from_the_nearest_one():
    c = StepCosts()
    seen(c, 4, 4, 2.0)
    seen(c, 4, 8, 3.0)
    # 6 requests of one row each read as 4 requests with 2 rows more, 3 as 4 with one less
    assert c.estimate(6, 6) == pytest.approx(2.5)
    assert c.estimate(3, 3) == pytest.approx(1.75)
    seen(c, 1, 1, 1.0)  # one point at batch 1: the other batch's slope (0.25 a row)
    assert c.estimate(1, 3) == pytest.approx(1.5)


def test_fewer_rows_than_measured_cost_at_least_their_share():
    c = StepCosts()
    seen(c, 2, 8, 4.0)
    assert c.estimate(2, 2) == pytest.approx(1.0)  # no slope known: in proportion
    seen(c, 2, 6, 3.9)  # a flat segment would extend to 3.9 - 0.05 * 4 = 3.7
    assert c.estimate(2, 2) == pytest.approx(3.7)


# ------------------------------------------------------------------------------- accept rates


def test_accept_rates_count_kept_and_rejected_trials():
    rates = AcceptRates()
    a, b = FakeReq(), FakeReq()
    assert rates.rate(a) == pytest.approx(0.5)  # the starting pooled rate
    rates.observe(a, drafted=3, emitted=4)  # all 3 kept: 3 trials, 3 kept
    assert a.spec_rate == (3.0, 3.0)
    rates.observe(a, drafted=3, emitted=2)  # 1 kept, then a rejection: 2 trials
    assert a.spec_rate == pytest.approx((0.8 * 3 + 1, 0.8 * 3 + 2))
    rates.observe(b, drafted=2, emitted=1)  # the first rejected: 1 trial, none kept
    assert b.spec_rate == (0.0, 1.0)
    assert rates.rate(b) < rates.pooled() < rates.rate(a)
    rates.observe(b, drafted=0, emitted=1)  # nothing drafted: nothing learnt
    assert b.spec_rate == (0.0, 1.0)
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)


# ------------------------------------------------------------------------------- the policy


def simulate(cost, rate_at, *, batch=1, k=3, steps=600, policy=None, seed=0):
    """Run ``steps`` steps; ``cost(rows)`` the mean step seconds, ``rate_at(step)`` the accept
    rate. Returns per step (tokens, seconds, cap)."""
    rng = random.Random(seed)
    policy = policy or AdaptiveDrafts(k)
    reqs = [FakeReq() for _ in range(batch)]
    out = []
    for step in range(steps):
        cap = policy.choose(reqs, [k] * batch, batch)
        rows = batch + batch * cap
        seconds = cost(rows) * rng.uniform(0.8, 1.2)
        policy.observe_step(batch, rows, seconds)
        tokens = 0
        for r in reqs:
            kept = 0
            while kept < cap and rng.random() < rate_at(step):
                kept += 1
            tokens += kept + 1
            if cap:
                policy.observe_verify(r, cap, kept + 1)
        out.append((tokens, seconds, cap))
    return out


def goodput(steps) -> float:
    return sum(t for t, _, _ in steps) / sum(s for _, s, _ in steps)


def best_fixed(cost, rate, batch=1, k=3) -> tuple[int, float]:
    rates = {j: batch * expected_tokens(rate, j) / cost(batch + batch * j) for j in range(k + 1)}
    j = max(rates, key=rates.get)
    return j, rates[j]


class FixedCap:
    """A policy that always verifies the full draft (the negative control)."""

    def __init__(self, k):
        self.k = k

    def choose(self, reqs, drafts, batch):
        return self.k

    def observe_step(self, *a):
        pass

    def observe_verify(self, *a):
        pass


MACHINES = {
    # weights dominate: an extra row costs 5% of a step
    "memory-bound": (lambda rows: 1.0 + 0.05 * rows, 0.8, 1, 3),
    # products dominate: rows cost in proportion, no draft can pay unless every one is kept
    "compute-bound": (lambda rows: 0.1 * rows, 0.6, 8, 0),
    # Qwen3.5-0.8B at batch 1 on the AVX2 EPYC: 1, 1.16, 1.46, 1.9 steps for 1-4 rows
    "zen1-batch1": (lambda rows: [1.0, 1.16, 1.46, 1.9][rows - 1], 0.8, 1, 2),
}


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_the_cap_reaches_the_best_fixed_caps_rate(machine):
    cost, rate, batch, want = MACHINES[machine]
    j, best = best_fixed(cost, rate, batch)
    assert j == want  # the machines are what their names say
    got = simulate(cost, lambda s: rate, batch=batch)
    late = got[len(got) // 3 :]
    assert goodput(late) >= 0.9 * best, (machine, goodput(late), best)
    caps = [c for _, _, c in late]
    assert max(set(caps), key=caps.count) == want, machine  # the cap it mostly ran


def test_a_fixed_full_draft_misses_the_bound_where_drafts_do_not_pay():
    """The negative control: the bound above fails for a policy that ignores the costs."""
    cost, rate, batch, _ = MACHINES["compute-bound"]
    _, best = best_fixed(cost, rate, batch)
    got = simulate(cost, lambda s: rate, batch=batch, policy=FixedCap(3))
    assert goodput(got[200:]) < 0.9 * best


def test_the_cap_follows_the_accept_rate_down_and_back_up():
    """Drafts kept 90% of the time, then 5%, then 90% again (a quoted document, prose, a
    document): each phase's second half runs within 0.85 of that phase's best fixed cap; the
    rise is seen through the probes at cap 0."""
    cost = MACHINES["zen1-batch1"][0]
    phase = 400
    rates = [0.9, 0.05, 0.9]
    got = simulate(cost, lambda s: rates[min(s // phase, 2)], steps=3 * phase)
    for i, rate in enumerate(rates):
        _, best = best_fixed(cost, rate)
        half = got[i * phase + phase // 2 : (i + 1) * phase]
        assert goodput(half) >= 0.85 * best, (i, rate, goodput(half), best)
    low = [c for _, _, c in got[phase + phase // 2 : 2 * phase]]
    assert low.count(0) >= len(low) * (1 - 2 / PROBE_EVERY)  # cap 0 but for the probes
    assert 1 in low  # and the probes ran


def test_small_gains_do_not_switch_the_cap():
    """Between two caps within 3% of each other the cap stays (step shapes repeat)."""
    policy = AdaptiveDrafts(3)
    reqs = [FakeReq()]
    policy.rates.kept = policy.rates.trials = 1.0  # every draft kept: tokens = 1 + cap
    for rows in range(1, 5):  # 1 + cap tokens for 1.0, 2.02, 3.04, 4.06 s: cap 0 best by 1.5%
        seen(policy.costs, 1, rows, 1.0 + 1.02 * (rows - 1))
    policy.cap = 3
    assert policy.choose(reqs, [3], 1) == 3  # 1.5% short of cap 0: kept
    seen(policy.costs, 1, 4, 5.0, times=SAMPLES)  # now clearly dearer
    assert policy.choose(reqs, [3], 1) == 0
