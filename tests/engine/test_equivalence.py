"""Equivalence matrix: outputs never depend on the cache, the strategy, the page size, the
prefill chunk size, overlap or the kernel backend (greedy, fp32), on a Gated DeltaNet and a
Mamba2 hybrid, and on the fake model (which has no near-ties at all, so there it must be exact).

Ids and the logprobs of the chosen tokens are compared. On the real models the reference is
the same engine with the cache off and the torch kernels; on the fake model it is the model's
closed-form outputs (``expected_greedy``), which share nothing with the engine's path.
``test_transformers_reference.py`` adds transformers itself as a reference with the cache on.
Each real model runs half of the cache-on configurations by default (any three factors in all
their combinations; the two models the two halves) and its other half under ``-m slow``; the
fake model runs them all."""

from __future__ import annotations

import itertools

import pytest
from engine_helpers import FakeModel
from equivalence_helpers import MAX_TIES, REFERENCE, compare, run, workload
from fake_model import expected_greedy

MATRIX = [
    dict(
        disable_radix_cache=not cache,
        mamba_scheduler_strategy=strategy,
        page_size=page,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=not overlap,
    )
    for cache, strategy, page, chunk, overlap in itertools.product(
        [True, False], ["no_buffer", "extra_buffer"], [1, 16], [-1, 64], [True, False]
    )
    if cache or strategy == "no_buffer"  # the strategy means nothing with the cache off
]
# Real models: every cache-on configuration plus the cache-off one furthest from the reference
# (the fake model below runs the whole matrix).
REAL_MATRIX = [
    f
    for f in MATRIX
    if not f["disable_radix_cache"]
    or (
        f["page_size"] == 16
        and f["chunked_prefill_size"] == 64
        and not f["disable_overlap_schedule"]
    )
]


FACTORS = ["mamba_scheduler_strategy", "page_size", "chunked_prefill_size",
           "disable_overlap_schedule"]  # fmt: skip


def _parity(flags: dict) -> int:
    """How many of the four two-level factors of a cache-on configuration are at their second
    level, mod 2. Each parity is half of the 16: a 2^(4-1) fraction of resolution IV, in which
    any three of the factors still meet in all 8 combinations."""
    second = (
        flags["mamba_scheduler_strategy"] == "extra_buffer",
        flags["page_size"] == 16,
        flags["chunked_prefill_size"] == 64,
        flags["disable_overlap_schedule"],
    )
    return sum(second) % 2


CACHE_OFF = [f for f in REAL_MATRIX if f["disable_radix_cache"]]
HALVES = [[f for f in REAL_MATRIX if not f["disable_radix_cache"] and _parity(f) == p]
          for p in (0, 1)]  # fmt: skip
# By default each model runs the cache-off configuration and one half, the two models the two
# halves (every configuration runs on one hybrid); ``-m slow`` runs each model's other half.
# The fake model below runs every configuration by default, exactly.
DEFAULT_HALF = {"qwen3_next": 0, "granite_hybrid": 1}


def real_matrix(name: str, part: str) -> list[dict]:
    """``part`` ``default``: the cache-off configuration and the model's half; ``rest``: the
    other half."""
    if part == "default":
        return CACHE_OFF + HALVES[DEFAULT_HALF[name]]
    return HALVES[1 - DEFAULT_HALF[name]]


@pytest.fixture(scope="module", params=["qwen3_next", "granite_hybrid"])
def real_model(request):
    from mambaradix.models.loader import load_model, load_tokenizer, resolve_model_path

    path = resolve_model_path(f"tiny:{request.param}")
    return request.param, load_model(path), load_tokenizer(path)


@pytest.fixture(scope="module")
def real_reference(real_model):
    """The workload and the reference's outputs on it, for every test of this model."""
    _, model, tok = real_model
    prompts = workload(model.vocab_size)
    return prompts, run(model, tok, prompts, REFERENCE)[0]


@pytest.mark.parametrize("part", ["default", pytest.param("rest", marks=pytest.mark.slow)])
def test_matrix_real_models(real_model, real_reference, part):
    name, model, tok = real_model
    prompts, ref = real_reference
    matrix = real_matrix(name, part)
    report = []
    for flags in matrix:
        got, hits = run(model, tok, prompts, flags)
        ties, worst = compare(ref, got)
        report.append((flags, hits, ties, worst))
        assert ties <= MAX_TIES, f"{ties} near-tie divergences under {flags}"
        if not flags["disable_radix_cache"]:
            assert hits > 0, flags
    print(f"\n{name}: {len(matrix)} configs x {len(prompts)} requests")
    for flags, hits, ties, worst in report:
        print(f"  hits {hits} near-ties {ties} max logprob diff {worst:.1e} under {flags}")


# where the strided backend's snapshots fall: chunk ends off the stride (qwen3_next), pages
STRIDED_FLAGS = {
    "qwen3_next": dict(page_size=1, chunked_prefill_size=100),
    "granite_hybrid": dict(page_size=16, chunked_prefill_size=-1),
}


def test_real_matrix_parts_cover_it():
    """Per model, the default and slow parts are REAL_MATRIX split in two, and the default
    part meets every combination of any three of the four cache-on factors (a bug that needs
    three of them shows by default); the two models' default parts hold every configuration."""
    for name in DEFAULT_HALF:
        default, rest = real_matrix(name, "default"), real_matrix(name, "rest")
        assert len(default) == 9 and len(rest) == 8
        assert sorted(map(str, default + rest)) == sorted(map(str, REAL_MATRIX))
        cache_on = [f for f in default if not f["disable_radix_cache"]]
        for three in itertools.combinations(FACTORS, 3):
            assert len({tuple(f[k] for k in three) for f in cache_on}) == 8, (name, three)
    both = [f for name in DEFAULT_HALF for f in real_matrix(name, "default")]
    assert {str(f) for f in both} == {str(f) for f in REAL_MATRIX}


def test_strided_backend_real_models(real_model, real_reference):
    """The native backend declaring it can write a state inside a prefill forward only every 64
    tokens (``strided_backend``; it raises if asked off the stride), cache on with
    ``extra_buffer``: the reference's ids and logprobs; snapshots were taken inside forwards on
    the stride and at forwards' ends (the planner cut the others: test_snapshot_stride.py)."""
    from strided_backend import strided_backend

    from mambaradix.kernels.cpu_backend import CpuBackend

    name, model, tok = real_model
    prompts, ref = real_reference
    flags = dict(STRIDED_FLAGS[name], mamba_scheduler_strategy="extra_buffer")
    base = CpuBackend if CpuBackend.available() else None
    with strided_backend(64, base) as (backend, counts):
        got, hits = run(model, tok, prompts, dict(flags, kernel_backend=backend))
    ties, _ = compare(ref, got)
    assert ties <= MAX_TIES, f"{ties} near-tie divergences"
    assert hits > 0 and counts.refused == [], vars(counts)
    assert counts.inside > 0 and counts.at_end > 0, vars(counts)


@pytest.mark.parametrize("strategy,slots", [("no_buffer", 12), ("extra_buffer", 24)])
def test_value_eviction_policy_real_models(real_model, real_reference, strategy, slots):
    """``--state-eviction-policy value`` in a state pool small enough that it evicts hundreds
    of states over the workload: the reference's ids and logprobs, with hits."""
    _, model, tok = real_model
    prompts, ref = real_reference
    flags = dict(
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=slots,
        state_eviction_policy="value",
        chunked_prefill_size=64,
    )
    got, stats = run(model, tok, prompts, flags, return_stats=True)
    ties, _ = compare(ref, got)
    assert ties <= MAX_TIES, f"{ties} near-tie divergences"
    assert stats.cached_tokens > 0 and stats.evicted_states > 100, stats


def test_matrix_fake_model_exact():
    """Every configuration gives the closed-form outputs and logprobs exactly (the fake model
    has a margin of 5 between its two candidate logits: no near-ties)."""
    model = FakeModel(eos_token_ids=[])
    prompts = workload(model.vocab_size, seed=1)
    want = [expected_greedy(p, 6) for p in prompts]
    for flags in [REFERENCE, *MATRIX]:
        got, _ = run(model, None, prompts, flags, max_new_tokens=6)
        for n, (g, (ids, lps)) in enumerate(zip(got, want)):
            assert g["output_ids"] == ids, (n, flags)
            diff = max(abs(a - b) for a, b in zip(g["meta_info"]["output_token_logprobs"], lps))
            assert diff <= 1e-5, (n, flags, diff)


def test_fake_model_reference_catches_a_lost_conv_state():
    """Negative control: an engine whose resume copies skip the conv state (temporal copied
    alone) must disagree with the closed form, so the exact test above can fail that way."""
    from mambaradix.cache.state_pool import StatePool

    model = FakeModel(eos_token_ids=[])
    prompts = workload(model.vocab_size, n=40, seed=2)
    want = [expected_greedy(p, 6)[0] for p in prompts]
    original = StatePool.copy

    def copy_temporal_only(self, src, dst):
        saved = [c.clone() for c in self.conv]
        original(self, src, dst)
        for c, before in zip(self.conv, saved):
            c.copy_(before)

    StatePool.copy = copy_temporal_only
    try:
        got, hits = run(model, None, prompts, MATRIX[0], max_new_tokens=6)
    finally:
        StatePool.copy = original
    assert hits > 0
    assert [g["output_ids"] for g in got] != want
