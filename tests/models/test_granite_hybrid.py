"""GraniteMoeHybrid (dense with RoPE, MoE without positional encoding) against transformers."""

from __future__ import annotations

import pytest
import torch
from model_oracle import ORACLE_CHECKS, OracleCase


def hf_mamba_state(cache, layer_idx: int):
    """transformers keeps the last K conv inputs; our pool keeps the last K-1."""
    conv = cache.get_conv_state(layer_idx)[0]
    return conv[:, 1:], cache.get_recurrent_state(layer_idx)[0]


CASES = [
    OracleCase("granite_hybrid_dense", "granite_hybrid", hf_state=hf_mamba_state),
    OracleCase("granite_hybrid_moe", "granite_hybrid_moe", hf_state=hf_mamba_state),
]


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_transformers(oracle_for, case, check):
    ORACLE_CHECKS[check](oracle_for(case))


def test_cases_cover_moe_rope_and_layer_mix(oracle_for):
    """The two cases really differ where they claim to (else a check could pass vacuously)."""
    from mambaradix.models.granite_hybrid import ATTENTION, MAMBA

    dense, moe = (oracle_for(c).model for c in CASES)
    assert all(layer.block_sparse_moe is None for layer in dense.model.layers)
    assert all(layer.block_sparse_moe is not None for layer in moe.model.layers)
    assert dense.rotary is not None and moe.rotary is None
    for m in (dense, moe):
        kinds = [layer.kind for layer in m.model.layers]
        assert {ATTENTION, MAMBA} <= set(kinds)
        assert m.kv_spec.num_layers == kinds.count(ATTENTION)
        assert len(m.state_spec.layers) == kinds.count(MAMBA)


def test_ssm_dtype_sets_temporal_state_dtype(oracle_for):
    from mambaradix.models.granite_hybrid import GraniteHybridForCausalLM

    o = oracle_for(CASES[0])
    m = GraniteHybridForCausalLM(o.config, ssm_dtype=torch.bfloat16)
    spec = m.state_spec.layers[0]
    assert spec.temporal_dtype == torch.bfloat16 and spec.conv_dtype == torch.float32
    assert spec.temporal_shape == (4, 32, 16)
