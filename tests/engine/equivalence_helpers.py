"""The equivalence tests' shared parts: a workload of shared prefixes, repeats and unrelated
prompts, the reference configuration, one engine run returning its outputs with logprobs, and
the comparison of two runs (ids and chosen-token logprobs, near-ties capped)."""

from __future__ import annotations

import random

from mambaradix.engine.engine import Engine

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


def run(model, tokenizer, prompts, flags, max_new_tokens=4, return_stats=False):
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    params["return_logprob"] = True
    pools = dict(max_total_tokens=1 << 15, max_mamba_cache_size=96)
    with Engine(
        model=model, tokenizer=tokenizer, debug_integrity=True, **{**pools, **flags}
    ) as eng:
        res = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.is_idle()
        eng.check_integrity()
        stats = eng.stats()
    if return_stats:
        return res, stats
    return res, stats.cached_tokens


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
