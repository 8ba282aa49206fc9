"""Torch reference kernels: gated delta rule, causal conv1d, and the kernel registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qn

from mambaradix.kernels.conv import causal_conv1d, causal_conv1d_update, conv_state_after
from mambaradix.kernels.gated_delta import (
    chunk_gated_delta_rule,
    naive_gated_delta_rule,
    recurrent_gated_delta_step,
)

ATOL = 1e-4


def _gdn_inputs(B, T, Hk, Hv, Dk, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, Dk, generator=g)
    k = torch.randn(B, T, Hk, Dk, generator=g)
    v = torch.randn(B, T, Hv, Dv, generator=g)
    gate = -F.softplus(torch.randn(B, T, Hv, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=g))
    s0 = torch.randn(B, Hv, Dk, Dv, generator=g) * 0.5
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
def test_chunk_equals_token_loop(T, heads):
    q, k, v, g, b, s0 = _gdn_inputs(2, T, heads[0], heads[1], 8, 12)
    out, st = chunk_gated_delta_rule(q, k, v, g, b, s0)
    ref, rst = naive_gated_delta_rule(q, k, v, g, b, s0)
    assert torch.allclose(out, ref, atol=ATOL)
    assert torch.allclose(st, rst, atol=ATOL)


def test_chunk_matches_transformers():
    q, k, v, g, b, s0 = _gdn_inputs(1, 150, 2, 4, 16, 16, seed=1)
    out, st = chunk_gated_delta_rule(q, k, v, g, b, s0)
    ref, rst = hf_qn.torch_chunk_gated_delta_rule(
        q, k, v, g, b, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.allclose(out, ref, atol=ATOL)
    assert torch.allclose(st, rst, atol=ATOL)


def test_step_matches_transformers_recurrent():
    q, k, v, g, b, s0 = _gdn_inputs(3, 1, 2, 4, 16, 8, seed=2)
    out, st = recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], b[:, 0], s0)
    ref, rst = hf_qn.torch_recurrent_gated_delta_rule(
        q, k, v, g, b, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.allclose(out, ref[:, 0], atol=ATOL)
    assert torch.allclose(st, rst, atol=ATOL)
    assert not torch.allclose(st, s0, atol=1e-2)  # the step did something


@pytest.mark.parametrize("cut", [1, 37, 64, 100])
def test_piecewise_chaining_is_exact(cut):
    q, k, v, g, b, s0 = _gdn_inputs(1, 129, 2, 2, 8, 8, seed=3)
    out, st = chunk_gated_delta_rule(q, k, v, g, b, s0)
    o1, s1 = chunk_gated_delta_rule(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], b[:, :cut], s0)
    sl = slice(cut, None)
    o2, s2 = chunk_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], b[:, sl], s1)
    assert torch.allclose(torch.cat([o1, o2], 1), out, atol=ATOL)
    assert torch.allclose(s2, st, atol=ATOL)


def test_right_padding_with_zero_beta_and_gate_keeps_state():
    q, k, v, g, b, s0 = _gdn_inputs(1, 40, 2, 2, 8, 8, seed=4)
    _, st = chunk_gated_delta_rule(q, k, v, g, b, s0)
    pad = 30
    qp, kp, vp = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    gp, bp = F.pad(g, (0, 0, 0, pad)), F.pad(b, (0, 0, 0, pad))
    _, stp = chunk_gated_delta_rule(qp, kp, vp, gp, bp, s0)
    assert torch.allclose(stp, st, atol=ATOL)


def _conv_ref(x, w, state, act=True):
    """Per-sequence reference: conv over [state | x] with F.conv1d."""
    full = torch.cat([state, x.t()], dim=1)[None]
    y = F.conv1d(full, w[:, None, :], groups=w.shape[0])[0].t()
    return F.silu(y) if act else y


def test_causal_conv1d_varlen_matches_per_sequence():
    g = torch.Generator().manual_seed(5)
    C, K, lens = 6, 4, [1, 2, 9, 3]
    w = torch.randn(C, K, generator=g)
    states = torch.randn(len(lens), C, K - 1, generator=g)
    xs = [torch.randn(n, C, generator=g) for n in lens]
    out = causal_conv1d(torch.cat(xs), w, None, states, lens, "silu")
    ref = torch.cat([_conv_ref(x, w, s) for x, s in zip(xs, states)])
    assert torch.allclose(out, ref, atol=1e-6)
    # A wrong layout (states ignored) must be caught by this comparison.
    bad = torch.cat([_conv_ref(x, w, torch.zeros_like(s)) for x, s in zip(xs, states)])
    assert not torch.allclose(out, bad, atol=1e-3)


def test_conv_update_steps_equal_prefill_and_state_after():
    g = torch.Generator().manual_seed(6)
    C, K, T = 5, 4, 7
    w, bias = torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    s0 = torch.randn(C, K - 1, generator=g)
    x = torch.randn(T, C, generator=g)
    full = causal_conv1d(x, w, bias, s0[None], [T], None)
    state = s0[None]
    for t in range(T):
        y, state = causal_conv1d_update(x[t : t + 1], state, w, bias, None)
        assert torch.allclose(y[0], full[t], atol=1e-6)
        assert torch.allclose(state[0], conv_state_after(x, s0, t + 1), atol=0)
    assert torch.equal(conv_state_after(x, s0, 1)[:, :2], s0[:, 1:])  # carried-in inputs kept


def test_states_at_any_position_equal_the_token_loop():
    """``states_at`` returns the state after m tokens for any m (inside a chunk, on a boundary,
    the end), per row, without splitting the sequence."""
    T, C = 150, 64
    q, k, v, g, b, s0 = _gdn_inputs(3, T, 2, 4, 8, 12, seed=5)
    # chunk ends (64, 128) come from the state just computed, the others from the chunk formula
    wanted = [(0, 1), (1, 5), (2, 63), (0, 64), (1, 65), (2, 128), (2, 130), (0, T), (1, 129)]
    *_, states = chunk_gated_delta_rule(q, k, v, g, b, s0, C, states_at=wanted)
    assert states.shape == (len(wanted), 4, 8, 12)
    for (row, m), st in zip(wanted, states):
        _, ref = naive_gated_delta_rule(
            q[row : row + 1, :m], k[row : row + 1, :m], v[row : row + 1, :m],
            g[row : row + 1, :m], b[row : row + 1, :m], s0[row : row + 1],
        )  # fmt: skip
        torch.testing.assert_close(st, ref[0], atol=ATOL, rtol=0)
    # negative control: the state one token earlier differs
    _, early = naive_gated_delta_rule(q[1:2, :64], k[1:2, :64], v[1:2, :64], g[1:2, :64],
                                      b[1:2, :64], s0[1:2])  # fmt: skip
    assert (early[0] - states[4]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="outside"):
        chunk_gated_delta_rule(q, k, v, g, b, s0, C, states_at=[(0, T + 1)])


def test_states_at_stays_finite_under_strong_decay():
    """Positions past the wanted one are masked before exp: with strong decay e^(c_i - c_t)
    for t > i would overflow, and inf * 0 is NaN."""
    q, k, v, g, b, s0 = _gdn_inputs(1, 64, 1, 1, 4, 4, seed=2)
    g = g * 200.0  # cumulative log decay reaches ~ -1e4 within the chunk
    *_, states = chunk_gated_delta_rule(q, k, v, g, b, s0, 64, states_at=[(0, 3)])
    _, ref = naive_gated_delta_rule(q[:, :3], k[:, :3], v[:, :3], g[:, :3], b[:, :3], s0)
    assert torch.isfinite(states).all()
    torch.testing.assert_close(states[0], ref[0], atol=ATOL, rtol=0)
