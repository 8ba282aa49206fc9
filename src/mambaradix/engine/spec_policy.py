"""Adaptive speculation (``--speculative-adaptive``): how many draft tokens a step verifies,
chosen from what the steps cost on this machine and what the requests' drafts have been
yielding.

A verify step pays for its extra rows whether or not the drafts are kept. Where the weights
dominate (one request, a memory-bound CPU) an extra row costs a fraction of a step and a draft
that is kept a third of the time pays; where the products dominate (tens of requests, or a
compute-bound CPU: four rows of Qwen3.5-0.8B cost 1.8-2.1x one row on the AVX2 EPYC) even a
good draft may not. Neither side is known in advance, and both move: accept rates with the
text (a quoted document, then free prose), costs with the batch and the machine's load.

Each step takes a cap ``j`` in ``0..k`` (a request verifies ``min(j, its draft)`` tokens; one
cap for the step, so that step shapes repeat and their recorded graphs replay) maximising the
expected tokens per second:

    tokens(j) = sum over the step's decoding requests of 1 + a + a^2 + .. + a^min(j, draft)
    seconds(j) = the step's cost with those rows (``StepCosts``)

where ``a`` is the request's accept rate: the chance a draft token is kept given the one before
was (``AcceptRates``: its own recent verifies, pulled towards the rate of all requests while it
has few). A cap runs until its step shape's cost is confirmed (``StepCosts``), then changes
only for an expected gain of more than ``SWITCH_GAIN``. After
``PROBE_EVERY`` steps at cap 0 with drafts on offer, one step verifies one token (a probe), so
that a rate that has risen is seen; a probe costs one row.

Outputs never depend on the cap (greedy acceptance emits greedy decoding's tokens; sampled
acceptance draws each token as decoding does), only the number of forwards does.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

SAMPLES = 9  # recent step times kept per shape (their median is its cost)
CONFIRM = 3  # of them, before a shape's cost is taken as measured
SWITCH_GAIN = 1.03  # a cap changes for an expected gain above this
PROBE_EVERY = 32  # steps at cap 0 (with drafts on offer) before a one-token probe
PRIOR_WEIGHT = 2.0  # the pooled rate counts as this many trials of a request's own
REQ_DECAY = 0.8  # a request's counts: the weight of a verify n verifies ago is 0.8^n
POOL_DECAY = 0.9  # the pooled counts, per verify
START_RATE = 0.5  # the pooled rate before any verify


class StepCosts:
    """Measured seconds of decode / verify steps (no prompt chunks, no step-graph recording)
    by the number of decoding requests ``batch`` and the rows the forward computed ``rows``
    (``batch`` plus the verified drafts): the median of the last ``SAMPLES`` steps of each
    shape, *confirmed* from ``CONFIRM`` of them. The first steps of a shape are the dear ones
    (the first of a kind in the process, the Python forward before its step graph replays:
    up to 2.8x the steady time here), so an unconfirmed shape counts as no dearer than the
    confirmed ones around it suggest, and the policy runs it until it is confirmed.

    ``estimate`` interpolates between the confirmed rows of that batch size (or, without any,
    all its rows); outside them it extends the nearest segment (or, with one point, the slope
    other batch sizes show). With nothing to go on it is optimistic toward the shape not yet
    tried (rows beyond cost nothing more, fewer rows cost proportionally less), so the policy
    tries it and measures it."""

    def __init__(self) -> None:
        self._at: dict[int, dict[int, deque[float]]] = {}

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        if batch < 1 or rows < batch or seconds <= 0:
            return
        self._at.setdefault(batch, {}).setdefault(rows, deque(maxlen=SAMPLES)).append(seconds)

    def samples(self) -> dict[int, list[tuple[int, list[float]]]]:
        """The kept step times: batch -> (rows, times oldest first) by rows."""
        return {b: [(t, list(v)) for t, v in sorted(at.items())] for b, at in self._at.items()}

    def confirmed(self, batch: int, rows: int) -> bool:
        return len(self._at.get(batch, {}).get(rows, ())) >= CONFIRM

    def estimate(self, batch: int, rows: int) -> float | None:
        at = self._at.get(batch)
        if not at:
            if not self._at:
                return None
            near = min(self._at, key=lambda b: (abs(b - batch), b))
            return self.estimate(near, rows)  # requests more or fewer than there: as rows
        sure = {t: statistics.median(v) for t, v in at.items() if len(v) >= CONFIRM}
        if rows in sure:
            return sure[rows]
        if not sure:
            return _extend({t: statistics.median(v) for t, v in at.items()}, rows, self._slopes)
        around = _extend(sure, rows, self._slopes)
        return min(around, min(at[rows])) if rows in at else around

    def _slopes(self) -> float | None:
        """Seconds per row over every batch size with two rows measured (first to last,
        averaged), None without any."""
        slopes = []
        for at in self._at.values():
            if len(at) >= 2:
                lo, hi = min(at), max(at)
                med = statistics.median
                slopes.append(max(0.0, (med(at[hi]) - med(at[lo])) / (hi - lo)))
        return sum(slopes) / len(slopes) if slopes else None


def _extend(knots: dict[int, float], rows: int, slopes) -> float:
    """The seconds at ``rows`` from ``knots`` (rows -> seconds): linear between two, the end
    segment beyond them, ``slopes()`` (or optimism) with one."""
    if rows in knots:
        return knots[rows]
    ts = sorted(knots)
    below = [t for t in ts if t < rows]
    above = [t for t in ts if t > rows]
    if below and above:
        lo, hi = below[-1], above[0]
        return knots[lo] + (knots[hi] - knots[lo]) * (rows - lo) / (hi - lo)
    pair = ts[:2] if above else ts[-2:]
    s = (
        max(0.0, (knots[pair[1]] - knots[pair[0]]) / (pair[1] - pair[0]))
        if len(pair) == 2
        else slopes()
    )
    if above:  # fewer rows than any measured: never cheaper than their share
        first = ts[0]
        floor = knots[first] * rows / first
        return floor if s is None else max(floor, knots[first] - s * (first - rows))
    last = ts[-1]
    return knots[last] + (s or 0.0) * (rows - last)


class AcceptRates:
    """Accept rates: a request's from its own verifies (counts decayed by ``REQ_DECAY`` a
    verify), with ``PRIOR_WEIGHT`` trials at the pooled rate of all requests (decayed by
    ``POOL_DECAY``). A verify of ``d`` draft tokens that emitted ``n`` tokens kept ``n - 1``
    of them in ``n - 1`` trials, plus one rejected trial when ``n - 1 < d``."""

    def __init__(self) -> None:
        self.kept = START_RATE * PRIOR_WEIGHT
        self.trials = PRIOR_WEIGHT

    def pooled(self) -> float:
        return self.kept / self.trials

    def rate(self, req) -> float:
        own_kept, own_trials = req.spec_rate or (0.0, 0.0)
        return (own_kept + PRIOR_WEIGHT * self.pooled()) / (own_trials + PRIOR_WEIGHT)

    def observe(self, req, drafted: int, emitted: int) -> None:
        kept = min(max(emitted - 1, 0), drafted)
        trials = kept + (kept < drafted)
        if trials == 0:
            return
        own_kept, own_trials = req.spec_rate or (0.0, 0.0)
        req.spec_rate = (REQ_DECAY * own_kept + kept, REQ_DECAY * own_trials + trials)
        self.kept = POOL_DECAY * self.kept + kept
        self.trials = POOL_DECAY * self.trials + trials


def expected_tokens(rate: float, drafted: int) -> float:
    """Tokens a verify of ``drafted`` tokens emits on average: 1 + a + .. + a^drafted."""
    return sum(rate**m for m in range(drafted + 1))


class AdaptiveDrafts:
    """The cap of each step (``choose``), fed back with each pure decode / verify step's time
    (``observe_step``) and each verify's outcome (``observe_verify``)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.costs = StepCosts()
        self.rates = AcceptRates()
        self.cap = k
        self._idle = 0  # steps at cap 0 with drafts on offer since the last verify
        self._held = 0  # steps at this cap since it was chosen

    def choose(self, reqs: Sequence, drafts: Sequence[int], batch: int) -> int:
        """The cap for a step of ``batch`` decoding requests, ``drafts[i]`` the draft tokens
        ``reqs[i]`` has on offer (only requests with some)."""
        if not drafts:
            return self.cap
        rates = [self.rates.rate(r) for r in reqs]
        best = self.cap
        good = {j: self._goodput(j, rates, drafts, batch) for j in range(self.k + 1)}
        if good[self.cap] is None:
            best = self.k  # nothing measured at all: the full draft first
        elif self._confirmed(self.cap, drafts, batch) or self._held > CONFIRM:
            top = max(good, key=lambda j: (good[j], -j))
            if good[top] > good[self.cap] * SWITCH_GAIN:
                best = top
        # else: a cap whose shape is not confirmed runs on until it is (a recorded step and
        # shapes that move with the drafts on offer: one step more at most)
        self._held = self._held + 1 if best == self.cap else 1
        self.cap = best
        cap = best
        if best == 0:
            self._idle += 1
            if self._idle >= PROBE_EVERY:
                cap, self._idle = 1, 0
        else:
            self._idle = 0
        return cap

    def _rows(self, j: int, drafts: Sequence[int], batch: int) -> int:
        return batch + sum(min(j, d) for d in drafts)

    def _confirmed(self, j: int, drafts: Sequence[int], batch: int) -> bool:
        return self.costs.confirmed(batch, self._rows(j, drafts, batch))

    def _goodput(
        self, j: int, rates: Sequence[float], drafts: Sequence[int], batch: int
    ) -> float | None:
        seconds = self.costs.estimate(batch, self._rows(j, drafts, batch))
        if seconds is None:
            return None
        tokens = (
            batch - len(drafts) + sum(expected_tokens(a, min(j, d)) for a, d in zip(rates, drafts))
        )
        return tokens / max(seconds, 1e-9)

    def observe_step(self, batch: int, rows: int, seconds: float) -> None:
        self.costs.observe(batch, rows, seconds)

    def observe_verify(self, req, drafted: int, emitted: int) -> None:
        self.rates.observe(req, drafted, emitted)
