"""The native ``cpu`` kernel backend against the torch reference kernels."""

from __future__ import annotations

import shutil

import pytest
import torch

from mambaradix.kernels import get_kernel, native

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)


def test_native_kernels_build_here():
    assert native.available(), "the native kernels failed to build (see the log)"


def _pools(slots_total, hk, hv, dk, dv, width, seed):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    conv = torch.randn(slots_total, conv_dim, width - 1, generator=g)
    ssm = torch.randn(slots_total, hv, dk, dv, generator=g) * 0.3
    weight = torch.randn(conv_dim, width, generator=g) * 0.5
    return g, conv, ssm, weight


@pytest.mark.parametrize(
    "hk,hv,dk,dv,width,activation,bias",
    [(2, 4, 8, 16, 4, "silu", False), (2, 2, 16, 8, 4, None, True), (1, 3, 8, 8, 2, "silu", True)],
)
def test_gated_delta_decode_matches_reference_in_place(hk, hv, dk, dv, width, activation, bias):
    """Same outputs, same new conv and delta states in the requests' slots, every other slot
    untouched; x given as a strided view (the qwen3_5 layout splits it out of a wider
    projection)."""
    B, S = 5, 12
    g, conv, ssm, weight = _pools(S, hk, hv, dk, dv, width, seed=hk + hv + width)
    conv_dim = conv.shape[1]
    x = torch.randn(B, conv_dim + 7, generator=g)[:, 3 : 3 + conv_dim]
    # the gate projections as strided columns of one [B, 2 Hv] tensor, as the layer has them;
    # one a + dt_bias above softplus's linear threshold (20)
    ab = torch.randn(B, 2 * hv, generator=g) * 3
    ab[0, 0] = 25.0
    a_log, dt_bias = torch.randn(hv, generator=g) * 0.5, torch.rand(hv, generator=g)
    gates = (ab[:, :hv], ab[:, hv:], a_log, dt_bias)
    b = torch.randn(conv_dim, generator=g) if bias else None
    slots = torch.tensor([7, 0, 11, 3, 5])
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref = get_kernel("gated_delta_decode", "torch")(
        x, ref_conv, ref_ssm, slots, weight, b, *gates, hk, activation
    )
    out = get_kernel("gated_delta_decode", "cpu")(
        x, conv, ssm, slots, weight, b, *gates, hk, activation
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv, ref_conv, atol=0, rtol=0)
    torch.testing.assert_close(ssm, ref_ssm, atol=1e-5, rtol=1e-5)
    # the slots really moved (a kernel that wrote nothing would match an untouched reference
    # only if the reference wrote nothing either)
    _, conv0, ssm0, _ = _pools(S, hk, hv, dk, dv, width, seed=hk + hv + width)
    assert not torch.allclose(ssm[slots], ssm0[slots])
    other = torch.tensor([i for i in range(S) if i not in slots.tolist()])
    assert torch.equal(ssm[other], ssm0[other]) and torch.equal(conv[other], conv0[other])


def test_gated_delta_decode_falls_back_for_other_dtypes():
    """bf16 pools are outside the C kernel: the cpu backend hands them to the reference."""
    hk, hv, dk, dv, width, B, S = 1, 2, 8, 8, 4, 3, 6
    g, conv, ssm, weight = _pools(S, hk, hv, dk, dv, width, seed=9)
    x = torch.randn(B, conv.shape[1], generator=g).bfloat16()
    gates = (torch.randn(B, hv, generator=g), torch.randn(B, hv, generator=g))
    gates += (torch.zeros(hv), torch.ones(hv))
    slots = torch.tensor([4, 1, 2])
    args = (slots, weight.bfloat16(), None, *gates, hk, "silu")
    ref = get_kernel("gated_delta_decode", "torch")(x, conv.clone(), ssm.clone(), *args)
    out = get_kernel("gated_delta_decode", "cpu")(x, conv, ssm, *args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


def test_gated_delta_decode_rejects_mismatched_shapes():
    hk, hv, dk, dv, width = 2, 4, 8, 8, 4
    g, conv, ssm, weight = _pools(4, hk, hv, dk, dv, width, seed=1)
    x = torch.randn(2, conv.shape[1] + 8, generator=g)
    with pytest.raises(ValueError, match="key heads"):
        get_kernel("gated_delta_decode", "cpu")(
            x, conv, ssm, torch.tensor([0, 1]), weight, None, torch.zeros(2, hv),
            torch.zeros(2, hv), torch.zeros(hv), torch.zeros(hv), hk,
        )  # fmt: skip


@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_matches_reference_on_dense_and_strided_rows(zero_centered):
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(32, generator=g) * 0.2
    dense = torch.randn(7, 5, 32, generator=g) * 3
    # the query half of a [T, heads, 2 * d] projection: rows of 32 with a row stride of 64
    strided = torch.randn(9, 4, 64, generator=g)[..., :32]
    for x in (dense, strided, dense[0, 0]):
        ref = get_kernel("rms_norm", "torch")(x, weight, 1e-6, zero_centered)
        out = get_kernel("rms_norm", "cpu")(x, weight, 1e-6, zero_centered)
        assert out.shape == x.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # negative control: a different eps moves the result
    far = get_kernel("rms_norm", "cpu")(dense * 1e-3, weight, 1e-2, zero_centered)
    near = get_kernel("rms_norm", "torch")(dense * 1e-3, weight, 1e-6, zero_centered)
    assert (far - near).abs().max() > 1e-2


def test_rms_norm_falls_back_for_bf16_and_unmergeable_views():
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(16, generator=g)
    x = torch.randn(6, 16, generator=g)
    for inp, w in ((x.bfloat16(), weight.bfloat16()), (x.t().contiguous().t(), weight)):
        ref = get_kernel("rms_norm", "torch")(inp, w, 1e-6, False)
        torch.testing.assert_close(get_kernel("rms_norm", "cpu")(inp, w, 1e-6, False), ref)


def test_rms_norm_gated_matches_reference_for_dense_and_strided_gates():
    """The GDN output norm: x dense ``[T, H, D]``, the gate either dense or a strided slice of a
    wider projection (the qwen3_next layout); other dtypes fall back to the reference."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(32, generator=g) * 0.5 + 1
    x = torch.randn(9, 4, 32, generator=g) * 2
    dense = torch.randn(9, 4, 32, generator=g) * 2
    strided = torch.randn(9, 4, 80, generator=g)[..., 16:48]
    assert not strided.is_contiguous()
    for gate in (dense, strided):
        ref = get_kernel("rms_norm_gated", "torch")(x, gate, weight, 1e-6)
        out = get_kernel("rms_norm_gated", "cpu")(x, gate, weight, 1e-6)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the gate is applied: a zero gate gives zeros (silu(0) = 0)
    zero = get_kernel("rms_norm_gated", "cpu")(x, torch.zeros_like(x), weight, 1e-6)
    assert torch.equal(zero, torch.zeros_like(x))
    half = get_kernel("rms_norm_gated", "cpu")(x.bfloat16(), dense.bfloat16(), weight, 1e-6)
    ref = get_kernel("rms_norm_gated", "torch")(x.bfloat16(), dense.bfloat16(), weight, 1e-6)
    assert half.dtype == torch.bfloat16 and torch.equal(half, ref)
