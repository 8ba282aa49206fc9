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
}  # fmt: skip


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
def test_matches_transformers(oracle_for, check):
    ORACLE_CHECKS[check](oracle_for(CASES["plain"]))


@pytest.mark.parametrize("variant", ["norm", "norm_first"])
@pytest.mark.parametrize("check", ["full_prompt", "decode_40", "mixed_batch"])
def test_mixer_norm_variants_match_transformers(oracle_for, variant, check):
    ORACLE_CHECKS[check](oracle_for(CASES[variant]))


def test_every_layer_is_in_both_pools(oracle_for):
    m = oracle_for(CASES["plain"]).model
    n = len(m.model.layers)
    assert m.kv_spec.num_layers == n and len(m.state_spec.layers) == n
    assert all(layer.mamba.norm is None for layer in m.model.layers)
