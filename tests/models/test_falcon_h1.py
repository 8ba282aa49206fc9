"""Falcon-H1 (attention and Mamba2 side by side in every layer, muP multipliers folded into the
weights) against transformers, without the mixer's output norm (the published default) and
with it, before or after the gate."""

from __future__ import annotations

import pytest
from model_oracle import ORACLE_CHECKS, OracleCase

CASES = {
    "plain": OracleCase("falcon_h1", "falcon_h1"),
    "norm": OracleCase("falcon_h1_norm", "falcon_h1", overrides=dict(mamba_rms_norm=True)),
    "norm_first": OracleCase(
        "falcon_h1_norm_first", "falcon_h1",
        overrides=dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
    ),
    # every projection with a bias but the mixer's input projection: the fused in_proj takes
    # zero rows for it, the fused out_proj the sum of two (drawn by the tiny init, not zeros)
    "biases": OracleCase(
        "falcon_h1_biases", "falcon_h1",
        overrides=dict(attention_bias=True, projectors_bias=True, mlp_bias=True),
    ),
}  # fmt: skip


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
def test_matches_transformers(oracle_for, check):
    ORACLE_CHECKS[check](oracle_for(CASES["plain"]))


@pytest.mark.parametrize("variant", ["norm", "norm_first"])
@pytest.mark.parametrize("check", ["full_prompt", "decode_40", "mixed_batch"])
def test_mixer_norm_variants_match_transformers(oracle_for, variant, check):
    ORACLE_CHECKS[check](oracle_for(CASES[variant]))


@pytest.mark.parametrize("check", ["full_prompt", "decode_40", "mixed_batch"])
def test_biases_match_transformers(oracle_for, check):
    o = oracle_for(CASES["biases"])
    layer = o.hf.model.layers[0]
    assert layer.self_attn.o_proj.bias.abs().min() > 0 and layer.mamba.in_proj.bias is None
    ORACLE_CHECKS[check](o)


def test_the_fused_projections(oracle_for):
    """Two linears per layer where the checkpoint has six: [mixer in | q | k | v] rows, [mixer
    out | o] columns."""
    o = oracle_for(CASES["plain"])
    ours, theirs = o.model.model.layers[0], o.hf.model.layers[0]
    att, mix = theirs.self_attn, theirs.mamba
    assert ours.in_proj.weight.shape[0] == sum(
        m.weight.shape[0] for m in (mix.in_proj, att.q_proj, att.k_proj, att.v_proj)
    )
    assert (
        ours.out_proj.weight.shape[1] == mix.out_proj.weight.shape[1] + att.o_proj.weight.shape[1]
    )
    linears = [n for n, m in o.model.model.layers[0].named_modules() if hasattr(m, "weight")
               and m.weight.dim() == 2 and "conv" not in n]  # fmt: skip
    assert sorted(linears) == ["feed_forward.down_proj", "feed_forward.gate_up_proj", "in_proj",
                               "out_proj"]  # fmt: skip


def test_every_layer_is_in_both_pools(oracle_for):
    m = oracle_for(CASES["plain"]).model
    n = len(m.model.layers)
    assert m.kv_spec.num_layers == n and len(m.state_spec.layers) == n
    assert all(layer.mamba.norm is None for layer in m.model.layers)
