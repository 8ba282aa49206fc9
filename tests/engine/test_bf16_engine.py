"""bf16 through the engine: greedy outputs with the cache on (both strategies, pages 1 and 16,
chunked prefill) against the same bf16 model with the cache off, on a tiny Gated DeltaNet model
and on a Qwen3.5-0.8B-shaped one cut to 4 layers (published widths, vocabulary cut).

bf16 carries 8 significant bits, so two correct computations of the same logits that split the
work differently (a resumed prefix instead of a full prompt, another chunking, another batch)
round differently. The tolerances below are that rounding, measured and stated:

- ``LOGPROB_ATOL`` per chosen token: 0.25. The bf16 tiny model's chosen-token logprobs differ
  from the same model's fp32 ones by up to 0.22 on this workload (p99 0.11): a cache-on/off
  difference up to that size is bf16 rounding, not the cache.
- ``MEAN_ATOL`` over a configuration's agreeing tokens: 0.0075. The logits leave a bf16 LM
  head; near |logit| 1-2 one bf16 step is 2^-7 = 0.0078, and most tokens come out the same
  both ways: measured means 0.0021-0.0029 (tiny) and, on the real shape, 0.0013 on an AMD
  EPYC and 0.0038-0.0053 on an Intel Xeon without AMX (family 6 model 207), where the sides take
  different fp32-accumulating matmuls for their different row counts (64-row prefill chunks
  with the cache on, whole prompts off): 0.0038 with torch's bf16 matmul for both, 0.0044 with
  fp32 ones from 128 rows, 0.0053 with the tile kernel from 12 rows (``kernels.cpu``). A zeroed
  resume on the real-shape model gives 0.011-0.013, one token off by 0.28 and a divergence at a
  0.63 gap.
- ``NEAR_TIE_GAP``: a greedy divergence is allowed only where the reference's best token beats
  the token the engine chose by less than 0.3 nats in the reference's own logprobs: about one
  token's rounding above (divergences at gaps of 0.10 were seen on the tiny model, and one at
  0.250 on an Intel Xeon with AMX, family 6 model 207, where torch's bf16 matmul runs on AMX
  tiles and the sides' row counts differ; the zeroed control diverges at 0.63).
- ``MAX_TIE_SHARE``: at most a quarter (+2) of the requests whose reference meets such a
  near-tie may diverge. A random model's logits are flat (all 512 logprobs of the tiny model
  within ~1 nat), so every tiny-model request meets one in 6 tokens; rounding noise (mean
  0.003, p99 ~0.07) flips a gap spread over [0, 0.25] far less often: 4-8 of 60 measured.

Negative control: resuming from a zeroed snapshot (conv and temporal state, KV intact) must
fail these checks. ``test_transformers_reference.py`` and ``tests/models/test_bf16_oracle.py``
compare with transformers."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest
import torch
from test_equivalence import workload

from mambaradix.core import SamplingParams
from mambaradix.engine.engine import Engine

LOGPROB_ATOL = 0.25
MEAN_ATOL = 0.0075
NEAR_TIE_GAP = 0.3
MAX_TIE_SHARE = 0.25
TOP = 20  # the most a request may ask for
NEW_TOKENS = 6

REFERENCE = dict(
    disable_radix_cache=True,
    disable_overlap_schedule=True,
    chunked_prefill_size=-1,
    skip_warmup=True,
)
CONFIGS = [
    dict(mamba_scheduler_strategy=s, page_size=p, chunked_prefill_size=64)
    for s in ("no_buffer", "extra_buffer")
    for p in (1, 16)
]

Output = tuple[list[int], list[tuple[list[int], list[float]]]]  # ids, per token top-5


def run_bf16(model, prompts: list[list[int]], flags: dict) -> tuple[list[Output], int]:
    """Greedy outputs with each token's top-5 (ids, logprobs), and the engine's hits."""
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=NEW_TOKENS,
        ignore_eos=True,
        return_logprob=True,
        top_logprobs=TOP,
    )
    with Engine(
        model=model,
        tokenizer=None,
        debug_integrity=True,
        max_total_tokens=1 << 15,
        max_mamba_cache_size=96,
        **flags,
    ) as eng:
        outs = []
        for handle in eng.submit_many(prompts, [params] * len(prompts)):
            ids, tops = [], []
            for event in handle.events():
                assert event.error is None, event.error
                ids += event.new_token_ids
                tops += event.new_top_logprobs or []
            outs.append((ids, tops))
        assert eng.is_idle()
        eng.check_integrity()
        hits = eng.stats().cached_tokens
    return outs, hits


@dataclass
class Report:
    ties: int  # greedy divergences at a near-tie (the rest of that request is not compared)
    wide: list[str]  # divergences that are not near-ties
    tie_requests: int  # reference requests that meet a near-tie (the cap's base)
    mean: float  # mean |chosen-token logprob difference| over the agreeing tokens
    worst: float

    @property
    def cap(self) -> int:
        return int(MAX_TIE_SHARE * self.tie_requests) + 2

    def check(self) -> None:
        assert not self.wide, self.wide[:3]
        assert self.worst <= LOGPROB_ATOL, f"a logprob off by {self.worst:.3f} > {LOGPROB_ATOL}"
        assert self.mean <= MEAN_ATOL, f"mean logprob difference {self.mean:.4f} > {MEAN_ATOL}"
        assert self.ties <= self.cap, f"{self.ties} near-tie divergences > cap {self.cap}"


def compare_bf16(ref: list[Output], got: list[Output]) -> Report:
    """Measure ``got`` against ``ref`` (``Report.check`` applies the tolerances above)."""
    ties = tie_requests = 0
    wide: list[str] = []
    diffs: list[float] = []
    for n, ((r_ids, r_top), (g_ids, g_top)) in enumerate(zip(ref, got)):
        assert len(r_ids) == len(g_ids) == len(r_top) == len(g_top) == NEW_TOKENS, n
        if any(t[1][0] - t[1][1] < NEAR_TIE_GAP for t in r_top):
            tie_requests += 1
        for i, (a, b) in enumerate(zip(r_ids, g_ids)):
            if a != b:
                alts = dict(zip(*r_top[i]))
                # not in the reference's top 20: its gap is at least the 20th's
                gap = alts[a] - alts.get(b, r_top[i][1][-1])
                if gap < NEAR_TIE_GAP:
                    ties += 1
                else:
                    wide.append(f"request {n} token {i}: {a} vs {b}, gap {gap:.3f}")
                break
            diffs.append(abs(r_top[i][1][0] - g_top[i][1][0]))  # the chosen token's logprob
    return Report(ties, wide, tie_requests, statistics.fmean(diffs), max(diffs))


def zeroed_resumes(monkeypatch) -> None:
    """Every state copy (a resume from the tree, a no_buffer snapshot) lands zeroed."""
    from mambaradix.cache.state_pool import StatePool

    original = StatePool.copy

    def copy_then_zero(self, src, dst):
        original(self, src, dst)
        self.clear(list(dst))

    monkeypatch.setattr(StatePool, "copy", copy_then_zero)


@pytest.fixture(scope="module")
def tiny_bf16():
    from mambaradix.models.loader import load_model, resolve_model_path

    model = load_model(resolve_model_path("tiny:qwen3_next"), dtype="bfloat16")
    prompts = workload(model.vocab_size, n=60)
    ref, _ = run_bf16(model, prompts, REFERENCE)
    return model, prompts, ref


@pytest.fixture(scope="module")
def real_shape_bf16(tmp_path_factory):
    """Qwen3.5-0.8B's published widths (GDN 16 x 128 heads, attention head_dim 256, GQA 4),
    4 layers (3 GDN + 1 attention), vocabulary cut to 4,096; a bf16 checkpoint."""
    from mambaradix.models.loader import load_model
    from mambaradix.models.published import build_published

    folder = tmp_path_factory.mktemp("qwen3_5_0_8b_cut")
    build_published("qwen3_5_0_8b", folder, layers=4, vocab=4096)
    model = load_model(str(folder), dtype="bfloat16")  # (auto is fp32 on CPUs without bf16 matmuls)
    assert next(model.parameters()).dtype == torch.bfloat16
    prompts = workload(model.vocab_size, n=16, seed=3)
    ref, _ = run_bf16(model, prompts, REFERENCE)
    return model, prompts, ref


def _check_configs(model, prompts, ref, configs) -> None:
    for flags in configs:
        got, hits = run_bf16(model, prompts, flags)
        assert hits > 0, flags
        rep = compare_bf16(ref, got)
        print(f"\nhits {hits} {rep} under {flags}")
        rep.check()


def test_bf16_cache_on_matches_off_tiny(tiny_bf16):
    model, prompts, ref = tiny_bf16
    assert next(model.parameters()).dtype == torch.bfloat16
    _check_configs(model, prompts, ref, CONFIGS)


def test_bf16_cache_on_matches_off_real_shape(real_shape_bf16):
    model, prompts, ref = real_shape_bf16
    _check_configs(model, prompts, ref, [CONFIGS[3]])


@pytest.mark.slow
def test_bf16_cache_on_matches_off_real_shape_all_configs(real_shape_bf16):
    model, prompts, ref = real_shape_bf16
    _check_configs(model, prompts, ref, CONFIGS)


def test_bf16_control_zeroed_snapshot_fails(real_shape_bf16, monkeypatch):
    """Negative control: the same checks fail when resumed states arrive zeroed. On the
    real-shape model: the tiny random model's chosen-token logprobs hardly depend on its
    recurrent state (a zeroed resume moved their mean to 0.008 only)."""
    model, prompts, ref = real_shape_bf16
    zeroed_resumes(monkeypatch)
    got, hits = run_bf16(model, prompts, CONFIGS[3])
    assert hits > 0
    rep = compare_bf16(ref, got)
    print(f"\ncontrol: {rep}")
    with pytest.raises(AssertionError):
        rep.check()
    # not by one token's rounding: a divergence far from a tie, or every token shifted
    assert rep.wide or rep.mean > MEAN_ATOL, rep
