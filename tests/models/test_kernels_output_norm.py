"""The recurrent mixers' output norm folded into their decode ops (``GatedNorm``): a decode-only
forward hands the gated norm to ``mamba2_mixer_decode`` / ``gdn_decode``, and the ``cpu``
backend finishes it inside the same C call (no separate norm op, no y tensor between them).

Each folded result is compared with the same backend's unfolded op followed by its norm op (the
path the layers took before, and still take for mixed batches) and with the torch reference's
composition, in bf16 and fp32 at published shapes; the states must be those of the unfolded
op. The norm op is made to raise, so the fold must have run in C. Controls: a norm over the
wrong groups, and another gate, are far outside the bounds met. A Mamba2 mixer without a norm
(Falcon-H1) folds its bare gate the same way."""

from __future__ import annotations

import shutil

import pytest
import torch

from mambaradix.core import ForwardReq
from mambaradix.kernels import cpu
from mambaradix.kernels import norm as norm_ops
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.norm import GatedNorm
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layout import ForwardLayout

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)

EPS = 1e-6


def spacing_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the dtype's spacing at each ``want`` (at least at the mean
    magnitude: near-zero values carry the absolute error of their larger neighbours)."""
    bits = 7 if want.dtype == torch.bfloat16 else 23
    w = want.double()
    mag = w.abs().clamp_min(w.abs().mean())
    return (got.double() - w).abs() / torch.exp2(torch.floor(torch.log2(mag)) - bits)


def _layout() -> ForwardLayout:
    """Three decodes in slots 4, 1 and 3 of a six-slot pool."""
    reqs = [ForwardReq(5 + i, [1], torch.arange(6 + i), s, []) for i, s in enumerate((4, 1, 3))]
    return ForwardLayout.build(reqs)


def _check_fold(got, composed, want, dtype) -> None:
    """``got`` (folded) within one rounding of ``composed`` (the unfolded op, then the norm
    op: the same arithmetic but for the silu's exp, exp_poly's against torch's, and the order
    of the sums) and as close to the torch reference ``want`` as ``composed`` is."""
    e = spacing_err(got, composed)
    bound = 1 if dtype == torch.bfloat16 else 4
    assert e.max() <= bound and e.mean() <= 0.02, (e.max(), e.mean())
    e_ref, e_composed = spacing_err(got, want).mean(), spacing_err(composed, want).mean()
    assert e_ref <= 1.05 * e_composed + 0.01, (e_ref, e_composed)


def _refuse(*a, **k):
    raise AssertionError("the norm ran as its own op: the decode kernel did not fold it")


# ---------------------------------------------------------------------------------- Mamba2


def _mamba2_case(heads: int, groups: int, dtype: torch.dtype):
    P, N, K, S = 64, 128, 4, 6
    inter, C = heads * P, heads * P + 2 * groups * N
    g = torch.Generator().manual_seed(heads + groups)
    # one projection row per request: [gate z | xBC | dt], the layer's split of in_proj
    proj = torch.randn(3, inter + C + heads, generator=g).to(dtype)
    z, xbc, dt_raw = proj.split([inter, C, heads], dim=-1)
    pools = (
        torch.randn(S, C, K - 1, generator=g).to(dtype),
        torch.randn(S, heads, P, N, generator=g) * 0.1,
    )
    params = (
        (torch.randn(C, K, generator=g) * 0.3).to(dtype),  # conv weight
        torch.randn(C, generator=g).to(dtype),  # conv bias
        "silu",
        (torch.randn(heads, generator=g) * 0.5).to(dtype),  # A_log
        torch.randn(heads, generator=g).to(dtype),  # dt_bias
        (0.0, float("inf")),
        torch.randn(heads, generator=g).to(dtype),  # D
        (heads, P, groups, N),
    )
    weight = (1 + 0.2 * torch.randn(inter, generator=g)).to(dtype)
    return z, xbc, dt_raw, pools, params, weight, inter // groups


def _mamba2_run(backend, case, norm):
    z, xbc, dt_raw, pools, params, weight, group = case
    pools = tuple(p.clone() for p in pools)
    out = backend.mamba2_mixer_decode(xbc, dt_raw, *pools, _layout(), *params, norm)
    return out, pools


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "heads,groups",
    [(24, 1), (64, 8)],  # Granite-4.0-H-350M (one group of 1,536), Nemotron-H-like
)
def test_mamba2_decode_folds_its_gate_first_norm(heads, groups, dtype, monkeypatch):
    case = _mamba2_case(heads, groups, dtype)
    z, _, _, _, _, weight, group = case
    norm = GatedNorm(z, weight, EPS, group)
    cpu_backend = CpuBackend()
    y, unfolded_pools = _mamba2_run(cpu_backend, case, None)
    composed = cpu.rms_norm_gate_first(y.view(3, -1), z, weight, EPS, group)
    want, _ = _mamba2_run(TorchBackend(), case, norm)

    monkeypatch.setattr(cpu, "rms_norm_gate_first", _refuse)
    monkeypatch.setattr(TorchBackend, "mamba2_mixer_decode", None)  # no composed fallback
    got, pools = _mamba2_run(cpu_backend, case, norm)
    monkeypatch.undo()

    assert got.dtype == dtype and got.shape == (3, heads * 64) and got.is_contiguous()
    for a, b in zip(pools, unfolded_pools):
        assert torch.equal(a, b)  # the fold leaves the states as the step alone does
    _check_fold(got, composed, want, dtype)
    # controls: another grouping, another gate
    regrouped = cpu.rms_norm_gate_first(y.view(3, -1), z, weight, EPS, group // 2)
    other = cpu.rms_norm_gate_first(y.view(3, -1), z.roll(1, 1), weight, EPS, group)
    for wrong in (regrouped, other):
        assert spacing_err(wrong, want).mean() > 20 * spacing_err(composed, want).mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mamba2_decode_folds_its_bare_gate(dtype, monkeypatch):
    """Without a norm (Falcon-H1: ``y * silu(z)``, a ``GatedNorm`` with no weight) the same
    C call finishes with the gate alone."""
    case = _mamba2_case(24, 1, dtype)  # Falcon-H1-0.5B's mixer: 24 heads of 64, one group
    z = case[0]
    gate = GatedNorm(z, None, 0.0, 64)
    cpu_backend = CpuBackend()
    y, unfolded_pools = _mamba2_run(cpu_backend, case, None)
    composed = norm_ops.silu_gate(y.view(3, -1), z)
    want, _ = _mamba2_run(TorchBackend(), case, gate)

    monkeypatch.setattr(norm_ops, "silu_gate", _refuse)
    monkeypatch.setattr(TorchBackend, "mamba2_mixer_decode", None)  # no composed fallback
    got, pools = _mamba2_run(cpu_backend, case, gate)
    monkeypatch.undo()

    assert got.dtype == dtype and got.shape == (3, 24 * 64) and got.is_contiguous()
    for a, b in zip(pools, unfolded_pools):
        assert torch.equal(a, b)
    _check_fold(got, composed, want, dtype)
    # controls: another gate, and the ungated y
    for wrong in (norm_ops.silu_gate(y.view(3, -1), z.roll(1, 1)), y.view(3, -1)):
        assert spacing_err(wrong, want).mean() > 20 * spacing_err(composed, want).mean() + 1


def test_mamba2_decode_runs_the_norm_op_where_it_cannot_fold(monkeypatch):
    """A gate that is not row-dense (or not the projection's rows) is not folded: the step, then
    the norm op, the same as the unfolded path."""
    case = _mamba2_case(24, 1, torch.bfloat16)
    z, _, _, _, _, weight, group = case
    y, _ = _mamba2_run(CpuBackend(), case, None)
    z_cols = z.t().contiguous().t()  # z's values, column-major
    want = cpu.rms_norm_gate_first(y.view(3, -1), z_cols, weight, EPS, group)
    calls = []
    gate_first = cpu.rms_norm_gate_first
    monkeypatch.setattr(cpu, "rms_norm_gate_first", lambda *a: calls.append(1) or gate_first(*a))
    got, _ = _mamba2_run(CpuBackend(), case, GatedNorm(z_cols, weight, EPS, group))
    assert calls and torch.equal(got, want)


# ---------------------------------------------------------------------------------- GDN


def _gdn_case(hk: int, hv: int, dtype: torch.dtype):
    dk = dv = 128
    width, S = 4, 6
    conv_dim = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(hk + hv)
    # [q|k|v | z | b | a], the layer's split of in_proj
    proj = torch.randn(3, conv_dim + hv * dv + 2 * hv, generator=g).to(dtype)
    mixed, z, b, a = proj.split([conv_dim, hv * dv, hv, hv], dim=-1)
    pools = (
        torch.randn(S, conv_dim, width - 1, generator=g).to(dtype),
        torch.randn(S, hv, dk, dv, generator=g) * 0.3,
    )
    params = (
        (torch.randn(conv_dim, width, generator=g) * 0.5).to(dtype),
        None,
        torch.randn(hv, generator=g).to(dtype),  # A_log
        torch.randn(hv, generator=g).to(dtype),  # dt_bias
        hk,
        "silu",
    )
    weight = (1 + 0.2 * torch.randn(dv, generator=g)).to(dtype)
    return mixed, z, b, a, pools, params, weight


def _gdn_run(backend, case, norm):
    mixed, z, b, a, pools, params, weight = case
    pools = tuple(p.clone() for p in pools)
    out = backend.gdn_decode(mixed, a, b, *pools, _layout(), *params, norm)
    return out, pools


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hk,hv", [(16, 16), (16, 32)])  # Qwen3.5 / Qwen3-Next shapes
def test_gdn_decode_folds_its_output_norm(hk, hv, dtype, monkeypatch):
    case = _gdn_case(hk, hv, dtype)
    _, z, _, _, _, _, weight = case
    norm = GatedNorm(z, weight, EPS, 128)
    cpu_backend = CpuBackend()
    core, unfolded_pools = _gdn_run(cpu_backend, case, None)
    composed = cpu.rms_norm_gated(core, z.reshape(core.shape), weight, EPS)
    want, _ = _gdn_run(TorchBackend(), case, norm)

    monkeypatch.setattr(cpu, "rms_norm_gated", _refuse)
    got, pools = _gdn_run(cpu_backend, case, norm)
    monkeypatch.undo()

    assert got.dtype == dtype and got.shape == (3, hv, 128) and got.is_contiguous()
    for x, y in zip(pools, unfolded_pools):
        assert torch.equal(x, y)
    _check_fold(got, composed, want, dtype)
    # controls: one norm over all heads instead of each head, another gate
    whole = cpu.rms_norm_gated(core.view(3, -1), z, weight.repeat(hv), EPS).view(core.shape)
    other = cpu.rms_norm_gated(core, z.roll(1, 1).reshape(core.shape), weight, EPS)
    for wrong in (whole, other):
        assert spacing_err(wrong, want).mean() > 20 * spacing_err(composed, want).mean()
