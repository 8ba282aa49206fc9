"""Mamba2's gate-first output norm (``weight * norm(x * silu(gate))`` per group) in C against
the torch reference and float64 truth, bf16 and fp32, one group and several, with strided
gates (a split view of the input projection, as the mixer passes it); and through the layer."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mambaradix.kernels import cpu, norm
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layers.norm import GatedRMSNorm

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)

EPS = 1e-6


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    want = want.double()
    spacing = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-100))) - 7)
    return (got.double() - want).abs() / spacing


def truth(x, gate, w, group):
    v = x.double() * F.silu(gate.double())
    shape = v.shape
    vg = v.reshape(*shape[:-1], shape[-1] // group, group)
    vg = vg * torch.rsqrt(vg.square().mean(-1, keepdim=True) + EPS)
    return w.double() * vg.reshape(shape)


def inputs(rows, dim, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    proj = (torch.randn(rows, 3 * dim, generator=g) * 2).to(dtype)
    gate, x = proj[:, :dim], proj[:, dim : 2 * dim]  # strided views, as in the mixer
    w = (torch.randn(dim, generator=g) * 0.2 + 1).to(dtype)
    return x.contiguous(), gate, w


@pytest.fixture
def no_reference(monkeypatch):
    monkeypatch.setattr(norm, "rms_norm_gate_first", lambda *a: pytest.fail("fell back"))


@pytest.mark.parametrize("dim, group", [(1536, 1536), (4096, 512), (3072, 1024)])
def test_bf16_against_reference_and_truth(dim, group, no_reference):
    x, gate, w = inputs(9, dim, seed=dim + group, dtype=torch.bfloat16)
    ref = TorchBackend.rms_norm_gate_first(x, gate, w, EPS, group)
    got = cpu.rms_norm_gate_first(x, gate, w, EPS, group)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert ulps(got, ref).max() <= 1  # the reference rounds at the same two places
    err = ulps(got, truth(x, gate, w, group))
    assert err.max() <= 2.0 and err.mean() <= 0.5, (err.max(), err.mean())
    whole = TorchBackend.rms_norm_gate_first(x, gate, w, EPS, dim)  # the control: one group
    if group != dim:
        assert ulps(whole, truth(x, gate, w, group)).mean() > 0.5  # the groups matter


@pytest.mark.parametrize("group", [768, 256])
def test_fp32_against_reference(group, no_reference):
    x, gate, w = inputs(5, 768, seed=group, dtype=torch.float32)
    ref = TorchBackend.rms_norm_gate_first(x, gate, w, EPS, group)
    got = CpuBackend.rms_norm_gate_first(x, gate, w, EPS, group)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    zero = CpuBackend.rms_norm_gate_first(x, torch.zeros_like(gate), w, EPS, group)
    assert zero.abs().max() == 0  # silu(0) = 0: the gate is applied before the norm


def test_the_layer_uses_it():
    torch.manual_seed(0)
    layer = GatedRMSNorm(1024, EPS, norm_before_gate=False, group_size=256).bfloat16()
    layer.weight.data.uniform_(0.5, 1.5)
    x, gate, _ = inputs(3, 1024, seed=1, dtype=torch.bfloat16)
    layer.bind_ops(TorchBackend())
    ref = layer(x, gate)
    layer.bind_ops(CpuBackend())
    assert ulps(layer(x, gate), ref).max() <= 1
    old = layer.weight * norm.rms_normalize(
        (x.float() * F.silu(gate.float())).view(3, 4, 256), EPS
    ).view(3, 1024).to(torch.bfloat16)  # what the layer computed before the op existed
    assert torch.equal(ref, old)
