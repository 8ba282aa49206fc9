"""Routed experts: the padded-bmm path (few tokens per expert) and the per-expert loop both
equal a token-by-token computation, on the checkpoint's ``[E, out, in]`` weight layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mambaradix.kernels import cpu, moe
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend
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
    assert gate_up.is_contiguous() and down.is_contiguous()
    x = torch.randn(tokens, H)
    logits = torch.randn(tokens, E)
    logits[:, 5] = -1e4  # expert 5 never chosen: an empty group on both paths
    w, ids = route_topk(logits, K, normalize=True)
    ref = _direct(x, w, ids, gate_up.detach(), down.detach())
    padded = tokens * K <= moe.PADDED_MAX_PER_EXPERT * E
    with torch.no_grad():
        got = experts_forward(x, w, ids, gate_up, down, "silu")
        old = moe.PADDED_MAX_PER_EXPERT
        try:  # the other path on the same input
            moe.PADDED_MAX_PER_EXPERT = 0 if padded else 1 << 30
            other = experts_forward(x, w, ids, gate_up, down, "silu")
        finally:
            moe.PADDED_MAX_PER_EXPERT = old
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other, ref, atol=1e-5, rtol=1e-5)


def test_both_paths_take_routing_weights_in_another_dtype():
    """fp32 routing weights with bf16 rows: each path rounds them to bf16 first, so both give
    bf16 rows equal to the result with bf16 weights (the loop once failed on the dtypes)."""
    torch.manual_seed(3)
    E, H, inter, K, T = 6, 16, 12, 2, 300
    gate_up = (torch.randn(E, 2 * inter, H) * 0.3).bfloat16()
    down = (torch.randn(E, H, inter) * 0.3).bfloat16()
    x = torch.randn(T, H).bfloat16()
    w, ids = route_topk(torch.randn(T, E), K, normalize=True)  # fp32
    for pad in (0, 1 << 30):  # the loop, then the padded GEMM
        old = moe.PADDED_MAX_PER_EXPERT
        try:
            moe.PADDED_MAX_PER_EXPERT = pad
            got = experts_forward(x, w, ids, gate_up, down, "silu")
            want = experts_forward(x, w.bfloat16(), ids, gate_up, down, "silu")
        finally:
            moe.PADDED_MAX_PER_EXPERT = old
        assert got.dtype is torch.bfloat16 and torch.equal(got, want)


# --------------------------------------------------------------------------- the C call


def _bf16_experts(E: int, H: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) * 0.1).bfloat16()
    down = (torch.randn(E, H, inter, generator=g) * 0.1).bfloat16()
    return g, gate_up, down


def _routed(g, tokens: int, E: int, K: int, unrouted: tuple[int, ...] = ()):
    logits = torch.randn(tokens, E, generator=g)
    logits[:, list(unrouted)] = -1e4
    w, ids = route_topk(logits, K, normalize=True)
    return w.bfloat16(), ids


def _per_row_blocks(x, w, ids, gate_up, down):
    """Each pair's expert block through the cpu backend's gated_mlp (one row), summed in fp32
    by weight and rounded once: the C call's arithmetic, but for its fp32 contractions."""
    be = CpuBackend()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            block = be.gated_mlp(x[t : t + 1], gate_up[e], down[e], "silu")[0]
            acc += w[t, k].float() * block.float()
        out[t] = acc.bfloat16()
    return out


@pytest.mark.parametrize("tokens,K", [(1, 1), (1, 4), (5, 4), (32, 4), (9, 1)])
def test_the_cpu_backends_moe_call_is_each_routed_experts_block(tokens, K):
    """bf16 decode batches (16 experts, at most 8 pairs an expert on average) run the C call
    (cpu.moe_experts is not None): one expert a token gives exactly the backend's gated_mlp of
    its row; k of them its fp32 weighted sum within one bf16 rounding (the C code may fuse the
    multiply-adds), and the torch reference (padded batched GEMMs) within bf16 rounding of
    every intermediate. Unrouted experts' weights are never used: NaN there changes nothing,
    NaN in a routed one reaches the output (the control)."""
    E, H, inter = 16, 256, 96  # (96: the activation's last chunk of a row is short)
    g, gate_up, down = _bf16_experts(E, H, inter, tokens * 10 + K)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    w, ids = _routed(g, tokens, E, K, unrouted=(3, 11))
    got = cpu.moe_experts(x, w, ids, gate_up, down, "silu")
    assert got is not None and got.shape == (tokens, H) and got.dtype == torch.bfloat16
    want = _per_row_blocks(x, w, ids, gate_up, down)
    if K == 1:
        assert torch.equal(got, want)
    else:
        ulp = want.float().abs() * 2.0**-7 + 1e-30
        assert ((got.float() - want.float()).abs() <= ulp).all()
    assert torch.equal(CpuBackend().moe_experts(x, w, ids, gate_up, down, "silu"), got)
    ref = TorchBackend().moe_experts(x, w, ids, gate_up, down, "silu")
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    poisoned_gu, poisoned_down = gate_up.clone(), down.clone()
    poisoned_gu[[3, 11]] = float("nan")
    poisoned_down[[3, 11]] = float("nan")
    assert torch.equal(cpu.moe_experts(x, w, ids, poisoned_gu, poisoned_down, "silu"), got)
    poisoned_down[int(ids[0, 0])] = float("nan")
    assert cpu.moe_experts(x, w, ids, poisoned_gu, poisoned_down, "silu")[0].isnan().any()


def test_the_cpu_backends_moe_call_takes_only_decode_batches_and_bf16():
    """Prefill-sized batches (more than 8 pairs an expert on average), fp32 and another
    activation get None from cpu.moe_experts and the reference from the backend."""
    E, H, inter, K = 4, 64, 32, 2
    g, gate_up, down = _bf16_experts(E, H, inter, 0)
    for tokens, dtype, act in ((17, torch.bfloat16, "silu"), (3, torch.float32, "silu"),
                               (3, torch.bfloat16, "gelu")):  # fmt: skip
        x = torch.randn(tokens, H, generator=g).to(dtype)
        w, ids = _routed(g, tokens, E, K)
        args = (x, w.to(dtype), ids, gate_up.to(dtype), down.to(dtype), act)
        assert cpu.moe_experts(*args) is None
        be = CpuBackend()  # the reference's composition over this backend's pad / unpad
        assert torch.equal(be.moe_experts(*args), TorchBackend.moe_experts(be, *args))


def test_the_cpu_backends_moe_call_skips_ids_out_of_range():
    """A pair whose expert id is outside 0..E-1 adds nothing (the C call never reads or
    writes past the weights or its scratch): the same as that pair with weight 0."""
    E, H, inter, K = 8, 64, 64, 2
    g, gate_up, down = _bf16_experts(E, H, inter, 1)
    x = torch.randn(3, H, generator=g).bfloat16()
    w, ids = _routed(g, 3, E, K)
    bad, zero = ids.clone(), w.clone()
    bad[1, 0], bad[2, 1] = E, -1
    zero[1, 0] = zero[2, 1] = 0
    got = cpu.moe_experts(x, w, bad, gate_up, down, "silu")
    assert got is not None
    assert torch.equal(got, cpu.moe_experts(x, zero, ids, gate_up, down, "silu"))
    assert not torch.equal(got, cpu.moe_experts(x, w, ids, gate_up, down, "silu"))


def test_the_cpu_backend_loops_over_the_routed_experts_for_fewer_pairs_than_experts(monkeypatch):
    """fp32 decode batches (no C call) of fewer (token, expert) pairs than experts take the
    per-expert loop, which reads only the routed experts' weights: the padded layout is never
    built (moe_pad raising changes nothing) and the result is the token-by-token one. From as
    many pairs as experts the padded GEMM runs (moe_pad raising then fails: the control)."""
    E, H, inter, K = 16, 32, 24, 2
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(E, 2 * inter, H, generator=g) * 0.3
    down = torch.randn(E, H, inter, generator=g) * 0.3

    def refuse(*args):
        raise AssertionError("the padded layout was built")

    monkeypatch.setattr(CpuBackend, "moe_pad", staticmethod(refuse))
    be = CpuBackend()
    for tokens in (1, 7):  # 2 and 14 pairs
        x = torch.randn(tokens, H, generator=g)
        w, ids = route_topk(torch.randn(tokens, E, generator=g), K, normalize=True)
        got = be.moe_experts(x, w, ids, gate_up, down, "silu")
        torch.testing.assert_close(got, _direct(x, w, ids, gate_up, down), atol=1e-5, rtol=1e-5)
    x = torch.randn(8, H, generator=g)
    w, ids = route_topk(torch.randn(8, E, generator=g), K, normalize=True)
    with pytest.raises(AssertionError, match="padded layout"):
        be.moe_experts(x, w, ids, gate_up, down, "silu")
