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


def _block(h, gated):
    """An expert's hidden row from its first GEMM: silu(gate) * up, or plain relu(up)^2."""
    if not gated:
        return F.relu(h).square()
    g, u = h.chunk(2)
    return F.silu(g) * u


def _direct(x, w, ids, gate_up, down, gated=True):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += w[t, j] * (down[e] @ _block(gate_up[e] @ x[t], gated))
    return out


def _both_paths(*args, gated=True):
    """``experts_forward`` on the loop, then on the padded GEMM."""
    old = moe.PADDED_MAX_PER_EXPERT
    try:
        outs = []
        for pad in (0, 1 << 30):
            moe.PADDED_MAX_PER_EXPERT = pad
            outs.append(experts_forward(*args, gated=gated))
        return outs
    finally:
        moe.PADDED_MAX_PER_EXPERT = old


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("tokens", [1, 5, 40, 300])
def test_both_paths_equal_direct_computation(tokens, gated):
    """Gated experts (silu(gate) * up, Qwen / Granite) and plain ones (relu(up)^2,
    Nemotron-H's) on both paths equal the token-by-token computation."""
    torch.manual_seed(tokens)
    E, H, inter, K = 6, 16, 12, 2
    rows = 2 * inter if gated else inter
    gate_up, down = expert_weights(E, rows, H), expert_weights(E, H, inter)
    with torch.no_grad():
        gate_up.copy_(torch.randn(E, rows, H) * 0.3)
        down.copy_(torch.randn(E, H, inter) * 0.3)
    assert gate_up.is_contiguous() and down.is_contiguous()
    x = torch.randn(tokens, H)
    logits = torch.randn(tokens, E)
    logits[:, 5] = -1e4  # expert 5 never chosen: an empty group on both paths
    w, ids = route_topk(logits, K, normalize=True)
    ref = _direct(x, w, ids, gate_up.detach(), down.detach(), gated)
    act = "silu" if gated else "relu2"
    with torch.no_grad():
        for got in _both_paths(x, w, ids, gate_up, down, act, gated=gated):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        with pytest.raises(RuntimeError):  # the control: gated read as plain fails on shapes
            experts_forward(x, w, ids, gate_up, down, act, gated=not gated)


def test_both_paths_sum_fp32_routing_weights_in_fp32():
    """fp32 routing weights with bf16 rows (Nemotron-H's router keeps fp32): both paths weigh
    the bf16 expert rows in fp32 and round the sum once, transformers' arithmetic (the loop
    once failed on the dtypes). Oracle: transformers' own ``NemotronHExperts`` on the same
    plain experts, which the loop equals bit for bit; rounding the weights to bf16 first gives
    other bits (the control)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    torch.manual_seed(3)
    E, H, inter, K, T = 6, 16, 12, 2, 300
    up = (torch.randn(E, inter, H) * 0.3).bfloat16()
    down = (torch.randn(E, H, inter) * 0.3).bfloat16()
    x = torch.randn(T, H).bfloat16()
    w, ids = route_topk(torch.randn(T, E), K, normalize=True)  # fp32
    config = NemotronHConfig(
        hidden_size=H, n_routed_experts=E, moe_intermediate_size=inter, moe_latent_size=None,
        mlp_hidden_act="relu2",
    )  # fmt: skip
    oracle = NemotronHExperts(config).bfloat16()
    with torch.no_grad():
        oracle.up_proj.copy_(up)
        oracle.down_proj.copy_(down)
        want = oracle(x, ids, w)
    loop, padded = _both_paths(x, w, ids, up, down, "relu2", gated=False)
    assert want.dtype is torch.bfloat16 and loop.dtype is torch.bfloat16
    assert padded.dtype is torch.bfloat16
    assert torch.equal(loop, want)
    torch.testing.assert_close(padded, want, rtol=1e-2, atol=1e-2)
    rounded = _both_paths(x, w.bfloat16(), ids, up, down, "relu2", gated=False)
    for got, control in zip((loop, padded), rounded):
        assert not torch.equal(got, control)


# --------------------------------------------------------------------------- the C call


def _bf16_experts(E: int, H: int, inter: int, seed: int, gated: bool = True):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if gated else inter
    gate_up = (torch.randn(E, rows, H, generator=g) * 0.1).bfloat16()
    down = (torch.randn(E, H, inter, generator=g) * 0.1).bfloat16()
    return g, gate_up, down


def _routed(g, tokens: int, E: int, K: int, unrouted: tuple[int, ...] = ()):
    logits = torch.randn(tokens, E, generator=g)
    logits[:, list(unrouted)] = -1e4
    w, ids = route_topk(logits, K, normalize=True)
    return w.bfloat16(), ids


def _per_row_blocks(x, w, ids, gate_up, down, gated=True):
    """Each pair's expert block on one row through the cpu backend (its gated_mlp, or its
    linear, relu² and linear for a plain expert), summed in fp32 by weight and rounded once:
    the C call's arithmetic, but for its fp32 contractions."""
    be = CpuBackend()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(ids.shape[1]):
            e, row = int(ids[t, k]), x[t : t + 1]
            if gated:
                block = be.gated_mlp(row, gate_up[e], down[e], "silu")[0]
            else:
                h = F.relu(be.linear(row, gate_up[e], None)).square()
                block = be.linear(h, down[e], None)[0]
            acc += w[t, k].float() * block.float()
        out[t] = acc.bfloat16()
    return out


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("tokens,K", [(1, 1), (1, 4), (5, 4), (32, 4), (9, 1)])
def test_the_cpu_backends_moe_call_is_each_routed_experts_block(tokens, K, gated):
    """bf16 decode batches (16 experts, at most 8 pairs an expert on average) run the C call
    (cpu.moe_experts is not None), gated silu experts and plain relu² ones (Nemotron-H's): one
    expert a token gives exactly the backend's block of its row; k of them its fp32 weighted
    sum within one bf16 rounding (the C code may fuse the multiply-adds), and the torch
    reference (padded batched GEMMs) within bf16 rounding of every intermediate. Unrouted
    experts' weights are never used: NaN there changes nothing, NaN in a routed one reaches the
    output (the control)."""
    E, H, inter = 16, 256, 96  # (96: the activation's last chunk of a row is short)
    act = "silu" if gated else "relu2"
    g, gate_up, down = _bf16_experts(E, H, inter, tokens * 10 + K, gated)
    x = torch.randn(tokens, H, generator=g).bfloat16()
    w, ids = _routed(g, tokens, E, K, unrouted=(3, 11))
    got = cpu.moe_experts(x, w, ids, gate_up, down, act, gated)
    assert got is not None and got.shape == (tokens, H) and got.dtype == torch.bfloat16
    want = _per_row_blocks(x, w, ids, gate_up, down, gated)
    if K == 1:
        assert torch.equal(got, want)
    else:
        ulp = want.float().abs() * 2.0**-7 + 1e-30
        assert ((got.float() - want.float()).abs() <= ulp).all()
    assert torch.equal(CpuBackend().moe_experts(x, w, ids, gate_up, down, act, gated), got)
    ref = TorchBackend().moe_experts(x, w, ids, gate_up, down, act, gated)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    poisoned_gu, poisoned_down = gate_up.clone(), down.clone()
    poisoned_gu[[3, 11]] = float("nan")
    poisoned_down[[3, 11]] = float("nan")
    poisoned = cpu.moe_experts(x, w, ids, poisoned_gu, poisoned_down, act, gated)
    assert torch.equal(poisoned, got)
    poisoned_gu[int(ids[0, 0])] = float("nan")  # (relu² keeps NaN: the first GEMM's reaches)
    assert cpu.moe_experts(x, w, ids, poisoned_gu, down, act, gated)[0].isnan().all()


def test_the_cpu_backends_moe_call_takes_only_decode_batches_and_bf16():
    """Prefill-sized batches (more than 8 pairs an expert on average), fp32 and another
    activation (gelu; relu² gated, silu plain) get None from cpu.moe_experts and the reference
    from the backend."""
    E, H, inter, K = 4, 64, 32, 2
    for tokens, dtype, act, gated in (
        (17, torch.bfloat16, "silu", True), (3, torch.float32, "silu", True),
        (3, torch.bfloat16, "gelu", True), (3, torch.bfloat16, "relu2", True),
        (17, torch.bfloat16, "relu2", False), (3, torch.bfloat16, "silu", False),
    ):  # fmt: skip
        g, gate_up, down = _bf16_experts(E, H, inter, tokens, gated)
        x = torch.randn(tokens, H, generator=g).to(dtype)
        w, ids = _routed(g, tokens, E, K)
        args = (x, w.to(dtype), ids, gate_up.to(dtype), down.to(dtype), act, gated)
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
