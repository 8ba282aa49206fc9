"""Qwen3-Next (dense, MoE) and Qwen3.5 against transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
from model_oracle import ORACLE_CHECKS, OracleCase

CASES = [
    OracleCase("qwen3_next_moe", "qwen3_next"),
    OracleCase("qwen3_next_dense", "qwen3_next", {"moe": False}),
    OracleCase("qwen3_5", "qwen3_5"),
    OracleCase("qwen3_5_moe", "qwen3_5_moe"),
]


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_transformers(oracle_for, case, check):
    o = oracle_for(case)
    ORACLE_CHECKS[check](o)


def test_moe_case_really_has_experts(oracle_for):
    from mambaradix.layers.moe import SparseMoeBlock

    moe = oracle_for(CASES[0]).model
    dense = oracle_for(CASES[1]).model
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in moe.layers)
    assert not any(isinstance(layer.mlp, SparseMoeBlock) for layer in dense.layers)
    kinds = {layer.mixer_kind for layer in moe.layers}
    assert kinds == {"attn", "gdn"}
