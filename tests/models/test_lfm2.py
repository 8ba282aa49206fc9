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


MOE_CASE = OracleCase("lfm2_moe", "lfm2_moe", hf_state=hf_conv_state)


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
def test_moe_matches_transformers(oracle_for, check):
    ORACLE_CHECKS[check](oracle_for(MOE_CASE))


def test_moe_case_has_dense_and_sparse_layers_and_a_routing_bias(oracle_for):
    """The tiny LFM2-MoE keeps its first layer dense, routes the rest, and its expert biases are
    large enough to change which experts are chosen (else the oracle would not test them)."""
    import torch

    from mambaradix.models.lfm2 import Lfm2FeedForward, Lfm2SparseMoe

    m = oracle_for(MOE_CASE).model
    ffs = [layer.feed_forward for layer in m.model.layers]
    assert isinstance(ffs[0], Lfm2FeedForward)
    assert all(isinstance(f, Lfm2SparseMoe) for f in ffs[1:])
    moe = ffs[1]
    assert moe.expert_bias.dtype == torch.float32 and moe.expert_bias.abs().min() > 0
    x = torch.randn(64, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(0))
    scores = torch.nn.functional.linear(x, moe.gate.weight).sigmoid()
    plain = scores.topk(moe.top_k, -1)[1].sort(-1)[0]
    biased = (scores + moe.expert_bias).topk(moe.top_k, -1)[1].sort(-1)[0]
    assert (plain != biased).any(-1).float().mean() > 0.2
