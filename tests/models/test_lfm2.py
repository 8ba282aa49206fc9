"""LFM2 (gated short convolution + attention with QK-norm) against transformers."""

from __future__ import annotations

import pytest
from model_oracle import ORACLE_CHECKS, OracleCase


def hf_conv_state(cache, layer_idx: int):
    """transformers keeps the last L conv inputs; our pool keeps the last L-1 (no temporal)."""
    conv = cache.get_conv_state(layer_idx)[0]
    return conv[:, 1:], None


CASE = OracleCase("lfm2", "lfm2", hf_state=hf_conv_state)


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
def test_matches_transformers(oracle_for, check):
    ORACLE_CHECKS[check](oracle_for(CASE))


def test_case_mixes_conv_and_attention(oracle_for):
    m = oracle_for(CASE).model
    kinds = [layer.is_attention for layer in m.model.layers]
    assert any(kinds) and not all(kinds)
    assert all(s.temporal_shape is None for s in m.state_spec.layers)
    assert all(s.conv_shape == (64, 2) for s in m.state_spec.layers)
