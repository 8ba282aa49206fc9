"""NemotronH (Mamba2 with n_groups > 1, attention, MLP and MoE blocks) against transformers."""

from __future__ import annotations

import pytest
from model_oracle import ORACLE_CHECKS, OracleCase


def mamba_layers(config) -> list[int]:
    return [i for i, t in enumerate(config.layers_block_type) if t == "linear_attention"]


def hf_mamba_state(cache, layer_idx: int):
    """transformers keeps the last K conv inputs; our pool keeps the last K-1."""
    conv = cache.get_conv_state(layer_idx)[0]
    return conv[:, 1:], cache.get_recurrent_state(layer_idx)[0]


CASE = OracleCase("nemotron_h", "nemotron_h", hf_state_layers=mamba_layers, hf_state=hf_mamba_state)


@pytest.mark.parametrize("check", list(ORACLE_CHECKS))
def test_matches_transformers(oracle_for, check):
    ORACLE_CHECKS[check](oracle_for(CASE))


def test_case_covers_every_block_kind_and_groups(oracle_for):
    o = oracle_for(CASE)
    kinds = [b.kind for b in o.model.backbone.layers]
    assert set(kinds) == {"linear_attention", "full_attention", "mlp", "moe"}
    mixer = next(b.mixer for b in o.model.backbone.layers if b.kind == "linear_attention")
    assert mixer.n_groups > 1


def test_group_limited_routing_masks_groups(oracle_for):
    """With topk_group 1 of 2 groups, both chosen experts come from one group."""
    import torch

    o = oracle_for(CASE)
    moe = next(b.mixer for b in o.model.backbone.layers if b.kind == "moe")
    idx, w = moe.gate(torch.randn(50, o.config.hidden_size))
    per = moe.gate.num_experts // moe.gate.n_group
    assert torch.all(idx[:, 0] // per == idx[:, 1] // per)
    assert torch.allclose(w.sum(-1), torch.ones(50) * moe.gate.scaling, atol=1e-5)


def test_router_stays_float32_in_bfloat16_model(oracle_for):
    import torch

    from mambaradix.models.nemotron_h import NemotronHForCausalLM

    m = NemotronHForCausalLM(oracle_for(CASE).config).to(torch.bfloat16)
    gate = next(b.mixer.gate for b in m.backbone.layers if b.kind == "moe")
    assert gate.weight.dtype == torch.float32
    assert m.backbone.embeddings.weight.dtype == torch.bfloat16
