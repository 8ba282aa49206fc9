"""Mamba2 kernels against transformers' torch paths (chunked scan and single-step update)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf_granite

from mambaradix.kernels.mamba2 import ChunkLayout, mamba2_chunk_scan, mamba2_step, process_dt

ATOL = 1e-4


def _inputs(T: int, H: int, P: int, G: int, N: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g)
    dt_raw = torch.randn(T, H, generator=g) * 0.5
    dt_bias = torch.rand(H, generator=g) - 0.5
    A = -torch.exp(torch.rand(H, generator=g) * 2)
    B = torch.randn(T, G, N, generator=g) * 0.5
    C = torch.randn(T, G, N, generator=g) * 0.5
    D = torch.rand(H, generator=g)
    return x, dt_raw, dt_bias, A, B, C, D


def _hf_scan(x, dt_raw, dt_bias, A, B, C, D, init, chunk=16):
    """transformers' chunked scan for one sequence; returns (y [L,H,P], final [H,P,N])."""
    y, final = hf_granite.mamba2_chunk_scan(
        x[None],
        dt_raw[None],
        A,
        B[None],
        C[None],
        chunk_size=chunk,
        D=D,
        dt_bias=dt_bias,
        initial_states=None if init is None else init[None],
        dt_softplus=True,
        return_final_states=True,
    )
    return y[0], final[0]


@pytest.mark.parametrize("G", [1, 2])
def test_varlen_chunk_scan_matches_transformers_per_sequence(G: int) -> None:
    H, P, N = 4, 8, 16
    lens = [1, 37, 64, 100, 5]
    T = sum(lens)
    x, dt_raw, dt_bias, A, B, C, D = _inputs(T, H, P, G, N)
    init = torch.randn(len(lens), H, P, N) * 0.3
    snaps = [[1], [10, 37], [], [64, 99, 3], [2]]
    plan = ChunkLayout.build(lens, snaps, chunk_size=16)
    dt = process_dt(dt_raw, dt_bias)
    y, final, snap_states = mamba2_chunk_scan(x, dt, A, B, C, D, init, plan)
    assert y.shape == (T, H, P) and final.shape == (len(lens), H, P, N)
    start, k = 0, 0
    for i, L in enumerate(lens):
        sl = slice(start, start + L)
        ref_y, ref_final = _hf_scan(x[sl], dt_raw[sl], dt_bias, A, B[sl], C[sl], D, init[i])
        torch.testing.assert_close(y[sl], ref_y, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(final[i], ref_final, atol=ATOL, rtol=1e-4)
        for n in snaps[i]:
            s2 = slice(start, start + n)
            _, ref_snap = _hf_scan(x[s2], dt_raw[s2], dt_bias, A, B[s2], C[s2], D, init[i])
            torch.testing.assert_close(snap_states[k], ref_snap, atol=ATOL, rtol=1e-4)
            k += 1
        start += L
    assert k == snap_states.shape[0]


def test_chunk_scan_initial_state_matters() -> None:
    """Negative control: a different start state must change the outputs."""
    H, P, G, N = 2, 4, 1, 8
    x, dt_raw, dt_bias, A, B, C, D = _inputs(20, H, P, G, N, seed=1)
    plan = ChunkLayout.build([20], None, chunk_size=8)
    dt = process_dt(dt_raw, dt_bias)
    y0, _, _ = mamba2_chunk_scan(x, dt, A, B, C, D, torch.zeros(1, H, P, N), plan)
    y1, _, _ = mamba2_chunk_scan(x, dt, A, B, C, D, torch.ones(1, H, P, N), plan)
    assert (y0 - y1).abs().max() > 1e-2


@pytest.mark.parametrize("G", [1, 2])
def test_step_matches_transformers_and_scan(G: int) -> None:
    S, H, P, N = 3, 4, 8, 16
    x, dt_raw, dt_bias, A, B, C, D = _inputs(S, H, P, G, N, seed=2)
    state = torch.randn(S, H, P, N)
    dt = process_dt(dt_raw, dt_bias)
    y, new = mamba2_step(state.clone(), x, dt, A, B, C, D)

    ref_state = state.clone()
    ref_y = hf_granite.mamba2_selective_state_update(
        ref_state,
        x,
        dt_raw[..., None].expand(-1, -1, P),
        A[:, None, None].expand(-1, P, N),
        B,
        C,
        D[:, None].expand(-1, P),
        z=None,
        dt_bias=dt_bias[:, None].expand(-1, P),
        dt_softplus=True,
    )
    torch.testing.assert_close(y, ref_y, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(new, ref_state, atol=ATOL, rtol=1e-4)

    # the same single tokens through the chunked scan
    plan = ChunkLayout.build([1] * S, None, chunk_size=16)
    y2, new2, _ = mamba2_chunk_scan(x, dt, A, B, C, D, state, plan)
    torch.testing.assert_close(y2, y, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(new2, new, atol=ATOL, rtol=1e-4)


def test_dt_limit_clamps() -> None:
    dt = process_dt(torch.full((2, 3), -20.0), torch.zeros(3), (0.01, 0.5))
    assert torch.all(dt == 0.01)
    dt = process_dt(torch.full((2, 3), 20.0), torch.zeros(3), (0.01, 0.5))
    assert torch.all(dt == 0.5)


def _naive(x, dt, A, B, C, D, h0):
    """Token-by-token float64 recurrence: the definition, independent of any chunking."""
    H = x.shape[1]
    hpg = H // B.shape[1]
    h = h0.double().clone()
    ys, states = [], []
    for t in range(x.shape[0]):
        Bt = B[t].double().repeat_interleave(hpg, 0)  # [H, N]
        Ct = C[t].double().repeat_interleave(hpg, 0)
        dtt = dt[t].double()
        h = h * torch.exp(dtt * A.double())[:, None, None]
        h = h + (dtt[:, None] * x[t].double())[..., None] * Bt[:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, Ct) + D.double()[:, None] * x[t].double())
        states.append(h.clone())
    return torch.stack(ys), states


def test_chunk_scan_matches_naive_recurrence_with_strong_decay() -> None:
    """Large |A| * dt (cumulative log-decay in the thousands) must not lose precision, and the
    states at odd offsets (pieces that end mid-chunk) equal the recurrence's."""
    H, P, G, N, L = 4, 8, 2, 16, 150
    x, dt_raw, dt_bias, _, B, C, D = _inputs(L, H, P, G, N, seed=3)
    A = -torch.tensor([0.5, 5.0, 40.0, 120.0])
    dt = process_dt(dt_raw, dt_bias + 1.0)
    h0 = torch.randn(1, H, P, N)
    offsets = [7, 64, 101, 149]
    plan = ChunkLayout.build([L], [offsets], chunk_size=32)
    y, final, snaps = mamba2_chunk_scan(x, dt, A, B, C, D, h0, plan)
    ref_y, ref_states = _naive(x, dt, A, B, C, D, h0[0])
    torch.testing.assert_close(y.double(), ref_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final[0].double(), ref_states[-1], atol=1e-4, rtol=1e-4)
    for k, n in enumerate(offsets):
        torch.testing.assert_close(snaps[k].double(), ref_states[n - 1], atol=1e-4, rtol=1e-4)
    # and the step kernel, token by token, agrees with the same recurrence
    h = h0
    for t in range(20):
        yt, h = mamba2_step(
            h.clone(), x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D
        )
        torch.testing.assert_close(yt[0].double(), ref_y[t], atol=1e-4, rtol=1e-4)
