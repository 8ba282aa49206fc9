"""A backend that writes a state inside a prefill forward only every ``snapshot_stride`` new
tokens (``BackendCapabilities``; a chunked GPU kernel keeping its chunk-boundary states): the
planner ends forwards at the snapshots it cannot take inside one, the backend is never asked for
one off its stride (it raises: ``strided_backend``), hits are those of a backend that can
snapshot anywhere, and outputs equal the fake model's closed form. The hit-rate contract runs
on this backend too (``test_hit_contract.py``), and so does a GDN and a Mamba2 hybrid against
the cache-off reference (``test_equivalence.py``)."""

from __future__ import annotations

import pytest
from engine_helpers import fake_engine, rand_tokens
from fake_model import expected_greedy
from strided_backend import strided_backend

from mambaradix.engine.outputs import EngineDeadError, RequestError
from mambaradix.engine.planner import Segment, plan_forward
from mambaradix.kernels.capabilities import BackendCapabilities

STRIDE = 64
PARAMS = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True, "return_logprob": True}


def test_planner_ends_the_forward_at_a_snapshot_off_the_stride():
    caps = BackendCapabilities(snapshot_stride=STRIDE)
    plan = lambda start, end, wanted, c=caps: plan_forward(  # noqa: E731
        start, end, 10_000, wanted, 64, "extra_buffer", c
    )
    assert plan(0, 300, [128]) == Segment(300, 128)  # offset 128: inside
    assert plan(0, 300, [99]) == Segment(99, 99)  # offset 99: the forward ends there
    assert plan(100, 300, [164]) == Segment(300, 164)  # offset 64 of this forward: inside
    assert plan(100, 300, [192]) == Segment(192, 192)  # offset 92: ends there
    assert plan(100, 300, [300]) == Segment(300, 300)  # the forward's last token: always
    # the same positions with a backend that writes anywhere stay inside the forward
    assert plan(0, 300, [99], BackendCapabilities()) == Segment(300, 99)
    assert plan(100, 300, [192], BackendCapabilities()) == Segment(300, 192)


def sequential_workload(rng) -> list[list[int]]:
    """Exact repeats of unaligned lengths, a shared prefix that branches off the stride, and
    next chat turns: snapshot positions both on and off the stride of their forwards."""
    system = rand_tokens(rng, 230)
    prompts = [system + rand_tokens(rng, 50) for _ in range(3)]
    prompts += [rand_tokens(rng, 100)] * 2 + [rand_tokens(rng, 129)] * 2  # repeat at 99, 128
    prompts.append(system + rand_tokens(rng, 27))  # resumes at 192, repeat point 256: offset 64
    prompts.append(prompts[0] + rand_tokens(rng, 70))
    return prompts


def run_sequential(backend: str, prompts, **flags) -> list[dict]:
    with fake_engine(kernel_backend=backend, **flags) as eng:
        out = [eng.generate(input_ids=p, sampling_params=PARAMS) for p in prompts]
        eng.check_integrity()
    for p, r in zip(prompts, out):
        ids, lps = expected_greedy(p, PARAMS["max_new_tokens"])
        assert r["output_ids"] == ids
        got = r["meta_info"]["output_token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, lps)) <= 1e-5
    return out


@pytest.mark.parametrize("chunk", [-1, 100])
@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_strided_backend_same_hits_and_outputs(strategy, chunk, rng):
    """Hits per request equal the default backend's (the planner cut forwards instead of losing
    snapshots); the backend saw snapshots inside forwards on its stride and at forwards' ends,
    and none off its stride. ``chunk`` 100 puts chunk-end snapshots off the stride."""
    prompts = sequential_workload(rng)
    flags = dict(mamba_scheduler_strategy=strategy, chunked_prefill_size=chunk)
    want = [r["meta_info"]["cached_tokens"] for r in run_sequential("auto", prompts, **flags)]
    with strided_backend(STRIDE) as (name, counts):
        got = run_sequential(name, prompts, **flags)
    assert [r["meta_info"]["cached_tokens"] for r in got] == want
    assert sum(want) > 0 and counts.refused == []
    if strategy == "extra_buffer":  # no_buffer copies after forwards: nothing reaches a backend
        assert counts.inside > 0 and counts.at_end > 0, vars(counts)


def test_control_a_planner_ignoring_the_capability_trips_the_backend(rng):
    """Negative control: the same workload with the planner told the backend writes anywhere
    asks the strided backend for a snapshot off its stride, which it refuses (the engine dies),
    so the test above would fail if the planner stopped reading the capability."""
    prompts = sequential_workload(rng)
    with strided_backend(STRIDE) as (name, counts):
        with fake_engine(kernel_backend=name, mamba_scheduler_strategy="extra_buffer") as eng:
            eng.scheduler.capabilities = BackendCapabilities()  # what the planner reads
            with pytest.raises((EngineDeadError, RequestError)):
                for p in prompts:
                    eng.generate(input_ids=p, sampling_params=PARAMS)
    assert counts.refused, "the planner never asked for a snapshot off the stride"
