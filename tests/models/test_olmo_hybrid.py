"""OLMo-Hybrid (Gated DeltaNet layers with doubled write strength, post-norm attention layers
with q/k normed across heads) against transformers."""

from __future__ import annotations

import pytest
import torch
from model_oracle import ORACLE_CHECKS, OracleCase, check_full_prompt

CASES = {
    "plain": OracleCase("olmo_hybrid", "olmo_hybrid"),
    # the write strength not doubled: beta_scale 1
    "no_neg_eigval": OracleCase(
        "olmo_hybrid_pos", "olmo_hybrid", overrides=dict(linear_allow_neg_eigval=False)
    ),
    # NoPE: no rope_theta, no rotation in the attention layers
    "nope": OracleCase(
        "olmo_hybrid_nope", "olmo_hybrid",
        overrides=dict(rope_parameters={"rope_type": "default", "rope_theta": None}),
    ),
}  # fmt: skip


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
def test_matches_transformers(oracle_for, check):
    ORACLE_CHECKS[check](oracle_for(CASES["plain"]))


@pytest.mark.parametrize("variant", ["no_neg_eigval", "nope"])
@pytest.mark.parametrize("check", ["full_prompt", "decode_40", "mixed_batch"])
def test_variants_match_transformers(oracle_for, variant, check):
    o = oracle_for(CASES[variant])
    assert (o.model.rotary is None) == (variant == "nope")
    ORACLE_CHECKS[check](o)


def test_the_layers_and_the_doubled_write_strength(oracle_for, monkeypatch):
    """Both layer kinds in the tiny model, Gated DeltaNet heads of 24 and 48 (not the 128 the
    kernels unroll), beta doubled; the control: beta left single fails the oracle."""
    o = oracle_for(CASES["plain"])
    layers = o.model.model.layers
    kinds = [layer.is_attention for layer in layers]
    assert any(kinds) and not all(kinds)
    gdn = [layer.linear_attn for layer in layers if not layer.is_attention]
    assert {(g.dk, g.dv, g.beta_scale) for g in gdn} == {(24, 48, 2.0)}
    for g in gdn:
        monkeypatch.setattr(g, "beta_scale", 1.0)
    with pytest.raises(AssertionError):
        check_full_prompt(o)
    monkeypatch.undo()
    check_full_prompt(o)


def test_attention_norms_span_all_heads(oracle_for):
    o = oracle_for(CASES["plain"])
    attn = next(layer.self_attn for layer in o.model.model.layers if layer.is_attention)
    assert attn.q_norm.weight.shape == (attn.num_heads * attn.head_dim,)
    assert attn.k_norm.weight.shape == (attn.num_kv_heads * attn.head_dim,)
    assert not torch.allclose(attn.q_norm.weight, torch.ones_like(attn.q_norm.weight))
