"""Speculative decoding in bf16: greedy outputs with speculation (NGRAM and the MTP head)
against the same bf16 model decoding without it, under ``test_bf16_engine``'s rule (a verify
forward rounds its k + 1 rows differently from k + 1 decode steps; divergences only at near
ties, chosen-token logprobs within bf16 rounding). Negative control: a verify that keeps the
state after every draft token, rejected ones included (no rollback), fails the rule."""

from __future__ import annotations

import pytest
from test_bf16_engine import NEW_TOKENS, REFERENCE, compare_bf16, run_bf16
from test_equivalence import workload

from mambaradix.cache.request_cache import RequestCache
from mambaradix.engine.engine import Engine
from mambaradix.models.loader import load_model
from mambaradix.models.tiny import make_tiny_checkpoint

FLAGS = dict(mamba_scheduler_strategy="no_buffer", page_size=1, disable_overlap_schedule=True)


@pytest.fixture(scope="module")
def bf16_mtp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_mtp_bf16")
    make_tiny_checkpoint("qwen3_5", str(folder), seed=1, mtp=True)
    model = load_model(str(folder), dtype="bfloat16", mtp=True)
    prompts = workload(model.vocab_size, n=24, seed=5)
    ref, _ = run_bf16(model, prompts, REFERENCE)
    return model, prompts, ref


def run_spec(model, prompts, algorithm: str):
    """Greedy outputs as ``run_bf16``'s, each token's top list being its own (id, logprob):
    top logprobs turn speculation off, so the gaps come from the reference's."""
    p = dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)
    with Engine(model=model, tokenizer=None, debug_integrity=True, max_total_tokens=1 << 15,
                max_mamba_cache_size=96, speculative_algorithm=algorithm,
                **FLAGS) as eng:  # fmt: skip
        res = eng.generate(input_ids=prompts, sampling_params=p)
        assert eng.stats().spec_verify_ct > 0
        eng.check_integrity()
    return [
        (r["output_ids"], [([t], [lp]) for t, lp in
                           zip(r["output_ids"], r["meta_info"]["output_token_logprobs"])])
        for r in res
    ]  # fmt: skip


@pytest.mark.parametrize("algorithm", ["NGRAM", "MTP"])
def test_bf16_greedy_with_speculation_matches_without(bf16_mtp, algorithm):
    model, prompts, ref = bf16_mtp
    compare_bf16(ref, run_spec(model, prompts, algorithm)).check()


def test_bf16_control_no_rollback_fails(bf16_mtp, monkeypatch):
    model, prompts, ref = bf16_mtp

    def keep_everything(self, rc, kept):  # the working slot: the state after every draft
        self.state_pool.free(rc.spec_slots)
        rc.spec_slots = []

    monkeypatch.setattr(RequestCache, "settle_spec", keep_everything)
    got = run_spec(model, prompts, "MTP")
    with pytest.raises(AssertionError, match="gap|logprob|near-tie"):
        compare_bf16(ref, got).check()
