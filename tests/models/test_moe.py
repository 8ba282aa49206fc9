"""Routed experts: the padded-bmm path (few tokens per expert) and the per-expert loop both
equal a token-by-token computation, on the input-major weight layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambaradix.layers import moe
from mambaradix.layers.moe import expert_weights, experts_forward, route_topk


def _direct(x, w, ids, gate_up, down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (down[e] @ (F.silu(g) * u))
    return out


@pytest.mark.parametrize("tokens", [1, 5, 40, 300])
def test_both_paths_equal_direct_computation(tokens):
    torch.manual_seed(tokens)
    E, H, inter, K = 6, 16, 12, 2
    gate_up, down = expert_weights(E, 2 * inter, H), expert_weights(E, H, inter)
    with torch.no_grad():
        gate_up.copy_(torch.randn(E, 2 * inter, H) * 0.3)
        down.copy_(torch.randn(E, H, inter) * 0.3)
    assert not gate_up.is_contiguous() and gate_up.transpose(1, 2).is_contiguous()
    x = torch.randn(tokens, H)
    logits = torch.randn(tokens, E)
    logits[:, 5] = -1e4  # expert 5 never chosen: an empty group on both paths
    w, ids = route_topk(logits, K, normalize=True)
    ref = _direct(x, w, ids, gate_up.detach(), down.detach())
    padded = tokens * K <= moe.PADDED_MAX_PER_EXPERT * E
    with torch.no_grad():
        got = experts_forward(x, w, ids, gate_up, down, F.silu)
        old = moe.PADDED_MAX_PER_EXPERT
        try:  # the other path on the same input
            moe.PADDED_MAX_PER_EXPERT = 0 if padded else 1 << 30
            other = experts_forward(x, w, ids, gate_up, down, F.silu)
        finally:
            moe.PADDED_MAX_PER_EXPERT = old
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other, ref, atol=1e-5, rtol=1e-5)
