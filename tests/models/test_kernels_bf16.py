"""Native bf16 kernels against the torch reference at real shapes (hidden sizes 1,024-4,096,
attention heads of 128 and 256 with partial rotary, Gated DeltaNet value heads of 128), and
against float64 truth with a tolerance that a bf16-accumulating kernel fails (negative
control). Each test also proves the native path ran (the reference fallback raises)."""

from __future__ import annotations

import shutil

import pytest
import torch

from mambaradix.kernels import cpu, norm, rope
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)

EPS = 1e-6


def ulps(got: torch.Tensor, want: torch.Tensor, floor: float | torch.Tensor = 2.0**-100):
    """|got - want| in units of the bf16 spacing at ``want`` (at least at ``floor``)."""
    want = want.double()
    mag = want.abs().clamp_min(floor)
    spacing = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    return (got.double() - want).abs() / spacing


def truth_rms_norm(x, w, zero_centered):
    xd = x.double()
    y = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS)
    return y * (1 + w.double()) if zero_centered else y * w.double()


def bf16_accumulated_rms_norm(x, w, zero_centered):
    """What a kernel summing squares in bf16 would give (the negative control)."""
    xf = x.float()
    acc = torch.zeros(x.shape[:-1], dtype=torch.bfloat16)
    for i in range(x.shape[-1]):
        acc = (acc.float() + xf[..., i] ** 2).bfloat16()
    y = xf * torch.rsqrt(acc.float()[..., None] / x.shape[-1] + EPS)
    return (y * (1 + w.float()) if zero_centered else y * w.float()).bfloat16()


def inputs(rows: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=g) * 2).bfloat16()
    w = (torch.randn(dim, generator=g) * 0.2 + (0.0 if seed % 2 else 1.0)).bfloat16()
    return x, w


@pytest.mark.parametrize("dim", [1024, 2048, 4096])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_bf16(dim, zero_centered):
    x, w = inputs(33, dim, seed=dim + zero_centered)
    ref = norm.rms_norm(x, w, EPS, zero_centered)
    got = cpu.rms_norm(x, w, EPS, zero_centered)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert ulps(got, ref.double()).max() <= 1  # the reference rounds alike: at most 1 ulp
    truth = truth_rms_norm(x, w, zero_centered)
    err = ulps(got, truth)
    # fp32 sums: within about one rounding (two where the reference rounds twice)
    assert err.max() <= 2.0 and err.mean() <= 0.5, (err.max(), err.mean())
    bad = ulps(bf16_accumulated_rms_norm(x, w, zero_centered), truth)
    assert bad.mean() > 0.5 or bad.max() > 2.0  # the tolerance catches bf16 accumulation


@pytest.mark.parametrize(
    "dim,scale,zero_centered",
    [
        (768, 0.22, False),
        (1024, 1.0, False),
        (1024, 1.0, True),
    ],  # Granite's multiplier; LFM2; Qwen3.5
)
def test_add_rms_norm_bf16(dim, scale, zero_centered, monkeypatch):
    """A residual add and the next norm in one pass: the new residual is bit for bit what the
    layer's own ops wrote (the product and the sum rounded to bf16), the norm within 1 ulp of the
    reference, on row-strided inputs. Control: the sum without the scale is another tensor."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(5, dim + 32, generator=g).bfloat16()[:, 16 : 16 + dim]
    res = (torch.randn(5, dim + 8, generator=g) * 3).bfloat16()[:, :dim]
    w = (torch.randn(dim, generator=g) * 0.2 + (0 if zero_centered else 1)).bfloat16()
    want_h, want = norm.add_rms_norm(x, res, w, EPS, zero_centered, scale)
    monkeypatch.setattr(cpu, "_fallback", None)  # the native path must run
    h, got = cpu.add_rms_norm(x, res, w, EPS, zero_centered, scale)
    monkeypatch.undo()
    assert torch.equal(h, want_h)
    assert (
        got.dtype == torch.bfloat16 and ulps(got, want, floor=want.float().abs().mean()).max() <= 1
    )
    if scale != 1.0:
        assert not torch.equal(cpu.add_rms_norm(x, res, w, EPS, zero_centered)[0], h)


def test_native_bf16_norm_paths_do_not_fall_back(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("fell back to the torch reference")

    monkeypatch.setattr(norm, "rms_norm", refuse)
    monkeypatch.setattr(norm, "rms_norm_gated", refuse)
    monkeypatch.setattr(rope, "rms_norm_rope", refuse)
    x, w = inputs(4, 1024, seed=3)
    cpu.rms_norm(x, w, EPS, True)
    cpu.rms_norm_gated(x, x, w, EPS)
    ang = torch.randn(4, 32)
    cs = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    cpu.rms_norm_rope(x.view(4, 4, 256), w[:256].contiguous(), EPS, True, *cs)
    with pytest.raises(AssertionError, match="fell back"):  # control: fp16 is not covered
        cpu.rms_norm(x.half(), w.half(), EPS, True)


@pytest.mark.parametrize("rows,dim", [(64 * 16, 128), (32 * 32, 128)])
def test_rms_norm_gated_bf16_gdn_output(rows, dim):
    """The Gated DeltaNet output norm: rows of one value head (d_v 128), silu gate."""
    x, w = inputs(rows, dim, seed=rows)
    gate = (torch.randn(rows, dim) * 2).bfloat16()
    ref = norm.rms_norm_gated(x, gate, w, EPS)
    got = cpu.rms_norm_gated(x, gate, w, EPS)
    assert got.dtype == torch.bfloat16
    assert ulps(got, ref.double()).max() <= 1
    silu = torch.nn.functional.silu(gate.double())
    truth = truth_rms_norm(x, w, False) * silu
    err = ulps(got, truth)
    assert err.max() <= 3.0 and err.mean() <= 0.5, (err.max(), err.mean())


@pytest.mark.parametrize("head_dim,rotary,heads", [(256, 64, 16), (128, 128, 8), (64, 64, 4)])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_rope_bf16_strided_heads(head_dim, rotary, heads, zero_centered):
    """Per-head q/k norm + rotate-half RoPE (Qwen3-Next / Qwen3.5: head 256, rotary 64), heads
    read in place from a wider projection (every other head)."""
    T = 9
    g = torch.Generator().manual_seed(head_dim + rotary)
    wide = (torch.randn(T, 2 * heads, head_dim, generator=g) * 2).bfloat16()
    x = wide[:, ::2]
    w = (torch.randn(head_dim, generator=g) * 0.2).bfloat16()
    pos = torch.arange(T, dtype=torch.float64)[:, None] * 37
    inv = 10000.0 ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    ang = torch.cat([pos * inv] * 2, -1)
    cos, sin = ang.cos().float(), ang.sin().float()
    ref = rope.rms_norm_rope(x, w, EPS, zero_centered, cos, sin)
    got = cpu.rms_norm_rope(x, w, EPS, zero_centered, cos, sin)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # truth: the normalised head as the reference rounds it, rotated exactly
    normed = norm.rms_norm(x, w, EPS, zero_centered).double()
    half = rotary // 2
    a, b = normed[..., :half], normed[..., half:rotary]
    c, s = cos.double()[:, None], sin.double()[:, None]
    rot = torch.cat(
        [a * c[..., :half] - b * s[..., :half], b * c[..., half:] + a * s[..., half:]], -1
    )
    truth = torch.cat([rot, normed[..., rotary:]], -1)
    err = ulps(got, truth)
    assert err.max() <= 1.0, err.max()  # rotated in fp32, rounded once
    # the reference rounds each product to bf16: where a*c - b*s cancels, its error is an
    # ulp of the products, not of the small result: measure at the head's largest value
    head_scale = normed.abs().amax(-1, keepdim=True)
    assert ulps(got, ref.double(), floor=head_scale).max() <= 2


def gdn_truth(x, conv, ssm, weight, a, b, A_log, dt_bias, hk):
    """One Gated DeltaNet decode token in float64 from bf16 inputs, holding the conv output and
    beta in bf16 as the torch reference does; returns (out, new conv, new ssm)."""
    B, C = x.shape
    hv, dk, dv = ssm.shape[1:]
    window = torch.cat([conv.double(), x.double()[..., None]], -1)
    y = (window * weight.double()).sum(-1)
    y = torch.nn.functional.silu(y).bfloat16().double()
    q, k, v = torch.split(y, [hk * dk, hk * dk, hv * dv], -1)
    q = q.view(B, hk, dk)
    k = k.view(B, hk, dk)
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() / dk**0.5
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    rep = hv // hk
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    v = v.view(B, hv, dv)
    sp = torch.nn.functional.softplus(a.double() + dt_bias.double())
    decay = torch.exp(-A_log.double().exp() * sp)
    beta = torch.sigmoid(b.double()).bfloat16().double()
    S = ssm.double() * decay[..., None, None]
    u = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", S, k))
    S = S + k[..., :, None] * u[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", S, q)
    return out, window[..., 1:], S


@pytest.mark.parametrize("hk,hv", [(16, 16), (16, 32)])
def test_gated_delta_decode_bf16_real_shapes(hk, hv, monkeypatch):
    """Qwen3.5 / Qwen3-Next shapes (key and value heads of 128, 16 key heads, 16 or 32 value
    heads, conv width 4): bf16 model tensors, fp32 delta state, updated in place."""
    from mambaradix.kernels import gated_delta

    dk = dv = 128
    width, B, S = 4, 4, 7
    conv_dim = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(hv)
    x_wide = (torch.randn(B, conv_dim + 64, generator=g)).bfloat16()
    x = x_wide[:, :conv_dim]  # a strided view, as the projection split gives it
    conv = (torch.randn(S, conv_dim, width - 1, generator=g)).bfloat16()
    ssm = torch.randn(S, hv, dk, dv, generator=g) * 0.3
    weight = (torch.randn(conv_dim, width, generator=g) * 0.5).bfloat16()
    a = torch.randn(B, hv, generator=g).bfloat16()
    b = torch.randn(B, hv, generator=g).bfloat16()
    A_log = torch.randn(hv, generator=g).bfloat16()
    dt_bias = torch.randn(hv, generator=g).bfloat16()
    slots = torch.tensor([5, 0, 3, 6])
    args = (weight, None, a, b, A_log, dt_bias, hk)
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref = gated_delta.gated_delta_decode(x, ref_conv, ref_ssm, slots, *args)
    got_conv, got_ssm = conv.clone(), ssm.clone()
    monkeypatch.setattr(gated_delta, "gated_delta_decode", None)  # no fallback allowed
    got = cpu.gated_delta_decode(x, got_conv, got_ssm, slots, *args)
    monkeypatch.undo()
    assert got.dtype == torch.bfloat16 and got_conv.dtype == torch.bfloat16
    assert got_ssm.dtype == torch.float32
    out_t, conv_t, ssm_t = gdn_truth(x, conv[slots], ssm[slots], weight, a, b, A_log, dt_bias, hk)
    assert torch.equal(got_conv[slots].double(), conv_t)  # the window shifts exactly
    assert torch.equal(ref_conv, got_conv)
    others = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(got_ssm[others], ssm[others]) and torch.equal(got_conv[others], conv[others])
    # the fp32 state: fp32-level error; a bf16 state would be ~1e-3 off (negative control)
    scale = ssm_t.abs().mean()
    err = (got_ssm[slots].double() - ssm_t).abs().mean() / scale
    bf16_state = (ssm_t.float().bfloat16().double() - ssm_t).abs().mean() / scale
    assert err < 1e-4 < bf16_state, (err, bf16_state)
    ref_err = (ref_ssm[slots].double() - ssm_t).abs().mean() / scale
    assert err <= 2 * ref_err + 1e-6  # as accurate as the reference
    floor = out_t.abs().mean()
    e = ulps(got, out_t, floor=floor)
    assert e.mean() <= 0.25 and e.max() <= 1, (e.mean(), e.max())  # one rounding of fp32
    # the torch reference rounds the conv products and the output's pieces to bf16: it is
    # further from the truth (up to ~8 ulps here); ours must not be worse on average
    assert e.mean() <= ulps(ref, out_t, floor=floor).mean()


@pytest.mark.parametrize(
    "channels,width,activation",
    [
        (1792 + 8, 4, "silu"),  # Granite-4.0-H-350M's Mamba2 xBC (+ a tail of 8 channels)
        (6144, 4, "silu"),  # Qwen3.5-0.8B's Gated DeltaNet q, k, v
        (1024 + 5, 3, None),  # LFM2-350M's short conv (+ a tail of 5)
    ],
)
def test_conv1d_update_bf16_real_shapes(channels, width, activation, monkeypatch):
    """The decode conv step, 16 channels a vector for widths 3 and 4 (the scalar loop for the
    tail): the state shifts exactly and only in the batch's slots; the output is what the torch
    reference computes (it rounds alike: each product, the sum, the bias add), to 1 ulp where the
    activation's exp differs in its last bits, and equal almost everywhere."""
    from mambaradix.kernels import conv as conv_ref

    g = torch.Generator().manual_seed(channels)
    B, S = 3, 6
    x_wide = torch.randn(B, channels + 40, generator=g).bfloat16()
    x = x_wide[:, 8 : 8 + channels]  # a row-strided view, as the projection split gives it
    pool = torch.randn(S, channels, width - 1, generator=g).bfloat16()
    weight = (torch.randn(channels, width, generator=g) * 0.5).bfloat16()
    bias = torch.randn(channels, generator=g).bfloat16() if activation else None
    slots = torch.tensor([4, 0, 2])
    want, want_state = conv_ref.causal_conv1d_update(
        x, pool[slots].clone(), weight, bias, activation
    )
    got_pool = pool.clone()
    monkeypatch.setattr(cpu, "_fallback", None)  # the native path must run
    got = cpu.conv1d_update(x, got_pool, slots, weight, bias, activation)
    monkeypatch.undo()
    assert got is not None and got.dtype == torch.bfloat16
    assert torch.equal(got_pool[slots], want_state)
    others = [s for s in range(S) if s not in slots.tolist()]
    assert torch.equal(got_pool[others], pool[others])
    e = ulps(got, want, floor=want.abs().mean())
    assert e.max() <= 1 and (e > 0).float().mean() <= 0.01, (e.max(), (e > 0).float().mean())
    # negative control: a state that did not shift gives other outputs
    stale = cpu.conv1d_update(x, pool.clone(), slots, weight, bias, activation)
    assert torch.equal(stale, got)  # same start state, same result
    again = cpu.conv1d_update(x, got_pool, slots, weight, bias, activation)
    assert ulps(again, want, floor=want.abs().mean()).mean() > 0.5


@pytest.mark.parametrize(
    "heads,groups,dt_limit",
    [
        (24, 1, (0.0, float("inf"))),  # Granite-4.0-H-350M: 24 heads of 64, one group
        (64, 8, (0.001, 0.1)),  # Nemotron-H-like: 8 groups, a clamped dt
    ],
)
def test_fused_mamba2_decode_matches_the_composed_step(heads, groups, dt_limit, monkeypatch):
    """The cpu backend's one-call Mamba2 decode (conv, dt, scan from the projection's views)
    against the torch backend's composition of the same steps, at published shapes, bf16: conv
    states equal, fp32 scan states to fp32 rounding, outputs to 1 ulp; only the batch's slots
    change. Control: the composition with another dt_bias is far off, so the match is not
    vacuous (its mean error is several times the bound met here)."""
    from mambaradix.core import ForwardReq
    from mambaradix.layout import ForwardLayout

    P, N, K, S = 64, 128, 4, 6
    C = heads * P + 2 * groups * N
    g = torch.Generator().manual_seed(heads)
    reqs = [
        ForwardReq(5 + i, [1], torch.arange(6 + i), slot, []) for i, slot in enumerate((4, 1, 3))
    ]
    layout = ForwardLayout.build(reqs)
    proj = torch.randn(3, 100 + C + heads, generator=g).bfloat16()
    xbc, dt_raw = proj[:, 100 : 100 + C], proj[:, 100 + C :]
    conv_pool = torch.randn(S, C, K - 1, generator=g).bfloat16()
    ssm_pool = torch.randn(S, heads, P, N, generator=g) * 0.1
    w = (torch.randn(C, K, generator=g) * 0.3).bfloat16()
    b = torch.randn(C, generator=g).bfloat16()
    A_log, dt_bias, D = (
        (torch.randn(heads, generator=g) * 0.5).bfloat16(),
        torch.randn(heads, generator=g).bfloat16(),
        torch.randn(heads, generator=g).bfloat16(),
    )
    shape = (heads, P, groups, N)

    def run(backend, bias=dt_bias):
        pools = conv_pool.clone(), ssm_pool.clone()
        y = backend.mamba2_mixer_decode(xbc, dt_raw, *pools, layout, w, b, "silu", A_log, bias,
                                        dt_limit, D, shape)  # fmt: skip
        return y, *pools

    want, want_conv, want_ssm = run(TorchBackend())
    monkeypatch.setattr(TorchBackend, "mamba2_mixer_decode", None)  # the native path must run
    got, got_conv, got_ssm = run(CpuBackend())
    monkeypatch.undo()
    assert got.dtype == torch.bfloat16 and got.shape == (3, heads, P)
    assert torch.equal(got_conv, want_conv)
    assert torch.equal(got_ssm[[0, 2, 5]], ssm_pool[[0, 2, 5]])  # slots outside the batch
    scale = want_ssm.abs().mean()
    assert (got_ssm - want_ssm).abs().max() <= 1e-5 * scale * 100
    e = ulps(got, want, floor=want.float().abs().mean())
    assert e.max() <= 1 and e.mean() <= 0.05, (e.max(), e.mean())
    other, _, _ = run(TorchBackend(), bias=dt_bias + 1)
    assert ulps(other, want, floor=want.float().abs().mean()).mean() > 0.1  # >> e.mean()


@pytest.mark.parametrize(
    "hq,hkv,d,sizes",
    [
        (16, 2, 256, [(4, 300), (3, 130), (2, 0)]),  # Qwen3-Next / Qwen3.5: head 256, GQA 8
        (16, 4, 128, [(5, 200), (1, 0)]),  # head 128, GQA 4
        (8, 4, 64, [(3, 0)]),  # head 64, GQA 2, no sharing
    ],
)
def test_attention_decode_bf16_pools(hq, hkv, d, sizes, monkeypatch):
    """bf16 K/V pools read in place, widened to fp32 per row (the scores, on a CPU with
    AVX-512 BF16, from its bf16 dot products: every shape here takes that path), merged with
    the shared pieces: close to a float64 softmax over each request's keys (the output's one
    bf16 rounding), at least as close as the torch cascade, and without falling back."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_kernels_cpu import _decode_case

    from mambaradix.kernels import attention

    q, k_pool, v_pool, table, lens = _decode_case(d + hq, hq, hkv, d, d, sizes, 90, size=2048)
    q, k_pool, v_pool = q.bfloat16(), k_pool.bfloat16(), v_pool.bfloat16()
    scale = d**-0.5
    ref = TorchBackend.attention_decode(q, k_pool, v_pool, table, lens, scale)
    monkeypatch.setattr(attention, "attention_decode", None)  # no fallback allowed
    out = CpuBackend.attention_decode(q, k_pool, v_pool, table, lens, scale)
    monkeypatch.undo()
    assert out.dtype == torch.bfloat16 and out.shape == (len(lens), hq, d)
    r = hq // hkv
    err, ref_err = [], []
    for b in range(len(lens)):
        keys = table[b, : lens[b]]
        k = k_pool[keys].double().repeat_interleave(r, dim=1).transpose(0, 1)
        v = v_pool[keys].double().repeat_interleave(r, dim=1).transpose(0, 1)
        p = torch.softmax((q[b].double()[:, None, :] * k).sum(-1) * scale, dim=-1)
        truth = (p[..., None] * v).sum(1)
        floor = truth.abs().mean()
        err.append(ulps(out[b], truth, floor=floor))
        ref_err.append(ulps(ref[b], truth, floor=floor))
    err, ref_err = torch.cat(err), torch.cat(ref_err)
    # fp32 throughout and one rounding at the end, but a shared piece comes from ATen's flash
    # kernel in bf16, rounded once more before the merge
    assert err.max() <= 2.5 and err.mean() <= 0.4, (err.max(), err.mean())
    assert err.mean() <= ref_err.mean() + 0.05


@pytest.mark.parametrize("T,K,E,H", [(64, 8, 128, 2048), (16, 10, 512, 1024), (40, 4, 32, 768)])
def test_moe_pad_unpad_bf16(T, K, E, H, monkeypatch):
    """MoE pair layout at real expert counts and top-k (Qwen3.5-MoE 512 experts top-10,
    Granite 32 top-4): bf16 rows placed exactly as the reference places them; the weighted
    sum back in fp32 (bf16 expert outputs, fp32 router weights) within one rounding of a
    float64 sum, no fallback."""
    from mambaradix.kernels import moe

    g = torch.Generator().manual_seed(E + K)
    x = torch.randn(T, H + 8, generator=g).bfloat16()[:, :H]  # strided rows
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ref_buf, ref_pos = moe.moe_pad(x, ids, E)
    monkeypatch.setattr(moe, "moe_pad", None)
    monkeypatch.setattr(moe, "moe_unpad", None)
    buf, pos = CpuBackend.moe_pad(x, ids, E)
    assert buf.dtype == torch.bfloat16
    assert torch.equal(pos, ref_pos) and torch.equal(buf, ref_buf)
    y = torch.randn(E, buf.shape[1], H, generator=g).bfloat16()
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    out = CpuBackend.moe_unpad(y, ids, pos, w)
    assert out.dtype == torch.float32  # bf16 outputs x fp32 weights: fp32, as in torch
    picked = y[ids.reshape(-1), pos].view(T, K, H).double()
    truth = (picked * w.double()[..., None]).sum(1)
    assert (out.double() - truth).abs().max() <= 1e-5 * truth.abs().max()
    out16 = CpuBackend.moe_unpad(y, ids, pos, w.bfloat16())
    truth16 = (picked * w.bfloat16().double()[..., None]).sum(1)
    assert out16.dtype == torch.bfloat16
    assert ulps(out16, truth16, floor=truth16.abs().mean()).max() <= 1.0


def test_a_fallback_is_named_once(caplog):
    """An input the native code does not cover (fp16) runs the reference and is logged once."""
    import logging

    from mambaradix.kernels import norm as norm_mod

    x, w = inputs(4, 256, seed=9)
    x, w = x.half(), w.half()
    cpu._REPORTED.discard(("rms_norm", torch.float16, torch.float16))
    with caplog.at_level(logging.WARNING, logger="mambaradix.kernels.cpu"):
        for _ in range(3):
            out = cpu.rms_norm(x, w, EPS, False)
    assert torch.equal(out, norm_mod.rms_norm(x, w, EPS, False))
    named = [r for r in caplog.records if "kernel rms_norm:" in r.getMessage()]
    assert len(named) == 1 and "float16" in named[0].getMessage()
