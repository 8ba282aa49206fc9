"""Equivalence matrix: outputs never depend on the cache, the strategy, the page size, the
prefill chunk size, overlap or the kernel backend (greedy, fp32), on a Gated DeltaNet and a
Mamba2 hybrid, and on the fake model (which has no near-ties at all, so there it must be exact).

Ids and the logprobs of the chosen tokens are compared. On the real models the reference is
the same engine with the cache off and the torch kernels; on the fake model it is the model's
closed-form outputs (``expected_greedy``), which share nothing with the engine's path.
``test_transformers_reference.py`` adds transformers itself as a reference with the cache on."""

from __future__ import annotations

import itertools
import random

import pytest
from engine_helpers import FakeModel
from fake_model import expected_greedy

from mambaradix.engine.engine import Engine

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
# The reference also runs the torch reference kernels and skips the warm-up forward; the
# matrix runs the default backend (native C kernels on CPU) after a warm-up, so every
# comparison checks those too.
REFERENCE = dict(
    disable_radix_cache=True,
    disable_overlap_schedule=True,
    chunked_prefill_size=-1,
    kernel_backend="torch",
    skip_warmup=True,
)
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
NEAR_TIE = 1e-4  # a divergence whose two logprobs differ by less is a near-tie (fp32 noise)
LOGPROB_ATOL = 1e-4  # where the ids agree, their logprobs agree to this (fp32)
MAX_TIES = 2  # near-tie divergences allowed per configuration (200 requests); more is a bug


def workload(vocab: int, n: int = 200, seed: int = 0) -> list[list[int]]:
    """Shared prefixes of varied lengths (some shorter than a page or the alignment), exact
    repeats and unrelated prompts, shuffled."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    systems = [tok(k) for k in (10, 40, 64, 100, 129, 200, 260)]
    prompts = []
    while len(prompts) < n:
        kind = rng.random()
        if kind < 0.7:
            prompts.append(rng.choice(systems) + tok(rng.randrange(1, 60)))
        elif kind < 0.85 and prompts:
            prompts.append(list(rng.choice(prompts)))
        else:
            prompts.append(tok(rng.randrange(2, 150)))
    return prompts


def run(model, tokenizer, prompts, flags, max_new_tokens=4):
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    params["return_logprob"] = True
    with Engine(
        model=model,
        tokenizer=tokenizer,
        debug_integrity=True,
        max_total_tokens=1 << 15,
        max_mamba_cache_size=96,
        **flags,
    ) as eng:
        res = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.is_idle()
        eng.check_integrity()
        hits = eng.stats().cached_tokens
    return res, hits


def compare(ref, got) -> tuple[int, float]:
    """(near-tie divergences, max logprob difference where the ids agree). The logprobs of
    every agreeing token must match within LOGPROB_ATOL; a divergence that is not a near-tie
    fails; after a near-tie the rest of that request is not compared (its inputs differ)."""
    ties = 0
    worst = 0.0
    for n, (r, g) in enumerate(zip(ref, got)):
        r_ids, g_ids = r["output_ids"], g["output_ids"]
        r_lp = r["meta_info"]["output_token_logprobs"]
        g_lp = g["meta_info"]["output_token_logprobs"]
        assert len(r_ids) == len(g_ids) == len(r_lp) == len(g_lp), f"request {n}: lengths"
        for i, (a, b) in enumerate(zip(r_ids, g_ids)):
            gap = abs(r_lp[i] - g_lp[i])
            if a != b:
                assert gap < NEAR_TIE, (
                    f"request {n} diverges at token {i} and it is not a near-tie (gap {gap:.2e})"
                )
                ties += 1
                break
            assert gap <= LOGPROB_ATOL, (
                f"request {n} token {i}: same id, logprobs differ by {gap:.2e}"
            )
            worst = max(worst, gap)
    return ties, worst


@pytest.fixture(scope="module", params=["qwen3_next", "granite_hybrid"])
def real_model(request):
    from mambaradix.models.loader import load_model, load_tokenizer, resolve_model_path

    path = resolve_model_path(f"tiny:{request.param}")
    return request.param, load_model(path), load_tokenizer(path)


def test_matrix_real_models(real_model):
    name, model, tok = real_model
    prompts = workload(model.vocab_size)
    ref, _ = run(model, tok, prompts, REFERENCE)
    report = []
    for flags in REAL_MATRIX:
        got, hits = run(model, tok, prompts, flags)
        ties, worst = compare(ref, got)
        report.append((flags, hits, ties, worst))
        assert ties <= MAX_TIES, f"{ties} near-tie divergences under {flags}"
        if not flags["disable_radix_cache"]:
            assert hits > 0, flags
    print(f"\n{name}: {len(REAL_MATRIX)} configs x {len(prompts)} requests")
    for flags, hits, ties, worst in report:
        print(f"  hits {hits} near-ties {ties} max logprob diff {worst:.1e} under {flags}")


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
