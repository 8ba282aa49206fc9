"""Equivalence matrix: outputs never depend on the cache, the strategy, the page size, the
prefill chunk size, overlap or the kernel backend (greedy, fp32), on a Gated DeltaNet and a
Mamba2 hybrid, and on the fake model (which has no near-ties at all, so there it must be exact)."""

from __future__ import annotations

import itertools
import random

import pytest
from engine_helpers import FakeModel

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
NEAR_TIE = 1e-4


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


def compare(ref, got) -> tuple[int, int]:
    """(divergent requests, of which near-ties); a divergence that is not a near-tie fails."""
    diverged = ties = 0
    for r, g in zip(ref, got):
        if r["output_ids"] == g["output_ids"]:
            continue
        diverged += 1
        i = next(k for k, (a, b) in enumerate(zip(r["output_ids"], g["output_ids"])) if a != b)
        gap = abs(
            r["meta_info"]["output_token_logprobs"][i] - g["meta_info"]["output_token_logprobs"][i]
        )
        assert gap < NEAR_TIE, f"divergence at token {i} is not a near-tie (gap {gap:.2e})"
        ties += 1
    return diverged, ties


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
        diverged, ties = compare(ref, got)
        report.append((flags, hits, ties))
        if not flags["disable_radix_cache"]:
            assert hits > 0, flags
    ties_total = sum(t for _, _, t in report)
    print(
        f"\n{name}: {len(REAL_MATRIX)} configs x {len(prompts)} requests, near-ties: {ties_total}"
    )
    for flags, _hits, ties in report:
        if ties:
            print(f"  near-tie divergences {ties} under {flags}")


def test_matrix_fake_model_exact():
    model = FakeModel(eos_token_ids=[])
    prompts = workload(model.vocab_size, seed=1)
    ref, _ = run(model, None, prompts, REFERENCE, max_new_tokens=6)
    for flags in MATRIX:
        got, _ = run(model, None, prompts, flags, max_new_tokens=6)
        assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref], flags
