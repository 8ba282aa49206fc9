"""The native prefill kernels (``cpu.mamba2_scan``, ``cpu.gated_delta_scan`` and
``cpu.conv1d_prefill``: the cpu backend's ``mamba2_prefill``, ``gdn_prefill`` and
``conv1d_prefill``) against the torch reference (the chunked forms of the scans), at published
shapes and at shapes off their vector paths."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_kernels_bf16 import ulps

from mambaradix.core import ForwardReq
from mambaradix.kernels import native
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.gated_delta import gdn_gates
from mambaradix.kernels.mamba2 import process_dt, split_xbc
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layout import ForwardLayout

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or not native.available(),
    reason="no C compiler: the native kernels cannot be built here",
)


def _layout(lens, snapshots):
    """Prefill segments ``lens`` in state slots 5, 1, 3; ``snapshots[i]`` the offsets segment i
    snapshots, into slots from 8 up."""
    spare = iter(range(8, 64))
    reqs = [
        ForwardReq(0, list(range(n)), torch.arange(n), slot, [(k, next(spare)) for k in offsets])
        for n, slot, offsets in zip(lens, [5, 1, 3], snapshots)
    ]
    return ForwardLayout.build(reqs)


def _case(shape, lens, snapshots, dtype, channel_major, seed):
    """``_layout``'s prefill and the scan's inputs as views of one conv output (channel-major as
    the prefill conv leaves it, or token-major)."""
    H, P, G, N = shape
    g = torch.Generator().manual_seed(seed)
    layout = _layout(lens, snapshots)
    T, C = sum(lens), H * P + 2 * G * N
    conv_out = torch.randn(C, T, generator=g).to(dtype).t() if channel_major else None
    if conv_out is None:
        conv_out = torch.randn(T, C, generator=g).to(dtype)
    x, B, Cm = split_xbc(conv_out, shape)
    dt = process_dt(torch.randn(T, H, generator=g) - 1.0, torch.zeros(H))
    A = -torch.exp(torch.rand(H, generator=g) * 2)
    D = torch.randn(H, generator=g).to(dtype)
    pool = torch.randn(64, H, P, N, generator=g) * 0.2
    return layout, (x, dt, A, B, Cm, D), pool


def _run(backend, layout, inputs, pool):
    pool = pool.clone()
    y = backend.mamba2_prefill(*inputs, pool, layout)
    return y, pool


@pytest.mark.parametrize(
    "shape,dtype,channel_major",
    [
        ((24, 64, 1, 128), torch.bfloat16, True),  # Granite-4.0-H-350M, as the conv leaves it
        ((16, 64, 8, 128), torch.bfloat16, False),  # Nemotron-H-like groups, token-major
        ((4, 128, 2, 64), torch.float32, True),  # P = 128: 8 vectors of y in registers
        ((6, 24, 3, 7), torch.float32, False),  # P not a multiple of 16, odd N: the scalar path
        ((2, 16, 1, 5), torch.bfloat16, True),  # one vector of p, odd N on the vector path
    ],
)
def test_native_scan_matches_the_chunked_scan(shape, dtype, channel_major, monkeypatch):
    """Outputs, final states and every snapshot (mid-chunk, at a chunk edge, at the segment's
    end, two at one offset) equal the reference's to fp32 rounding over several segments of
    uneven lengths; slots outside the forward stay untouched."""
    lens = [150, 64, 3]  # (a 1-token segment without a prefix would be a decode)
    snaps = [[1, 64, 100, 150], [37, 37], [1, 3]]
    layout, inputs, pool = _case(shape, lens, snaps, dtype, channel_major, seed=sum(shape))
    want_y, want_pool = _run(TorchBackend(), layout, inputs, pool)
    monkeypatch.setattr(TorchBackend, "mamba2_prefill", None)  # the native path must run
    got_y, got_pool = _run(CpuBackend(), layout, inputs, pool)
    assert got_y.dtype == torch.float32 and got_y.shape == want_y.shape
    touched = [5, 1, 3, *range(8, 16)]
    untouched = [i for i in range(64) if i not in touched]
    assert torch.equal(got_pool[untouched], pool[untouched])
    assert not torch.equal(got_pool[touched], pool[touched])
    scale = want_pool[touched].abs().mean()
    assert (got_pool[touched] - want_pool[touched]).abs().max() <= 5e-5 * scale  # seen: 5e-6
    assert (got_y - want_y).abs().max() <= 1e-4 * want_y.abs().mean()  # seen: 7e-6


def test_native_scan_snapshot_control(monkeypatch):
    """A snapshot is the state after exactly its offset: the state one token later differs by
    far more than the tolerance the match above meets (so an off-by-one would fail it)."""
    shape = (24, 64, 1, 128)
    layout, inputs, pool = _case(shape, [80], [[40]], torch.bfloat16, True, seed=1)
    later, _, _ = _case(shape, [80], [[41]], torch.bfloat16, True, seed=1)
    monkeypatch.setattr(TorchBackend, "mamba2_prefill", None)
    _, at40 = _run(CpuBackend(), layout, inputs, pool)
    _, at41 = _run(CpuBackend(), later, inputs, pool)
    scale = at40[8].abs().mean()
    assert (at40[8] - at41[8]).abs().max() > 100 * 5e-5 * scale
    assert torch.equal(at40[5], at41[5])  # the same final state either way


def _gdn_case(hk, hv, dk, dv, lens, snapshots, dtype, channel_major, seed):
    """``_layout``'s prefill and the Gated DeltaNet prefill's inputs as views of one conv
    output."""
    g_ = torch.Generator().manual_seed(seed)
    layout = _layout(lens, snapshots)
    T, C = sum(lens), 2 * hk * dk + hv * dv
    conv_out = (
        torch.randn(C, T, generator=g_).to(dtype).t()
        if channel_major
        else torch.randn(T, C, generator=g_).to(dtype)
    )
    q, k, v = conv_out.split([hk * dk, hk * dk, hv * dv], dim=-1)
    a, b = torch.randn(T, hv, generator=g_).to(dtype), torch.randn(T, hv, generator=g_).to(dtype)
    g, beta = gdn_gates(a, b, torch.rand(hv, generator=g_), torch.randn(hv, generator=g_))
    inputs = (q.reshape(T, hk, dk), k.reshape(T, hk, dk), v.reshape(T, hv, dv), g, beta)
    pool = torch.randn(64, hv, dk, dv, generator=g_) * 0.1
    return layout, inputs, pool


def _gdn_run(backend, layout, inputs, pool):
    pool = pool.clone()
    return backend.gdn_prefill(*inputs, pool, layout), pool


@pytest.mark.parametrize(
    "hk,hv,dk,dv,dtype,channel_major",
    [
        (16, 16, 128, 128, torch.bfloat16, True),  # Qwen3.5-0.8B, as the conv leaves it
        (4, 8, 128, 128, torch.bfloat16, False),  # Qwen3-Next's 2 value heads a key head
        (2, 4, 16, 48, torch.float32, True),  # a vector block of 32 columns + 16 scalar ones
        (1, 2, 7, 5, torch.float32, False),  # odd dims: the scalar path only
    ],
)
def test_native_gdn_scan_matches_the_chunked_rule(hk, hv, dk, dv, dtype, channel_major,
                                                  monkeypatch):  # fmt: skip
    """Outputs, final states and every snapshot of the native Gated DeltaNet prefill equal the
    chunked reference's: states to fp32 rounding, bf16 outputs within 1 ulp (almost all
    equal); slots outside the forward untouched."""
    lens = [150, 64, 3]
    snaps = [[1, 64, 100, 150], [37, 37], [1, 3]]
    layout, inputs, pool = _gdn_case(hk, hv, dk, dv, lens, snaps, dtype, channel_major, seed=dk)
    want, want_pool = _gdn_run(TorchBackend(), layout, inputs, pool)
    monkeypatch.setattr(TorchBackend, "gdn_prefill", None)  # the native path must run
    got, got_pool = _gdn_run(CpuBackend(), layout, inputs, pool)
    assert got.dtype == dtype and got.shape == want.shape
    touched = [5, 1, 3, *range(8, 16)]
    untouched = [i for i in range(64) if i not in touched]
    assert torch.equal(got_pool[untouched], pool[untouched])
    scale = want_pool[touched].abs().mean()
    err = (got_pool[touched] - want_pool[touched]).abs().max() / scale
    assert err <= 2e-4, err
    if dtype == torch.bfloat16:
        e = ulps(got, want, floor=want.float().abs().mean())
        assert e.max() <= 1 and e.mean() <= 0.01, (e.max(), e.mean())  # seen: 1, 8e-5
    else:
        assert (got - want).abs().max() <= 1e-4 * want.abs().mean()


@pytest.mark.parametrize(
    "hk,hv,dk,dv,dtype",
    [
        (2, 4, 128, 64, torch.bfloat16),  # published head dim, two vector blocks
        (1, 2, 66, 32, torch.float32),  # two rows past the last multiple of 4
        (1, 1, 131, 40, torch.bfloat16),  # three rows past it, and a scalar block
    ],
)
@pytest.mark.parametrize("cut", [2, 37, 198])  # (a 1-token part would be a decode)
def test_native_gdn_scan_resumed_equals_whole(hk, hv, dk, dv, dtype, cut, monkeypatch):
    """A segment scanned in one call equals, bit for bit, the same tokens scanned in two calls,
    the second resuming from the state the first left (what a cache hit does): outputs and
    final state. The vector path sums the next token's S^T k inside the current token's
    update pass; a resumed call sums it in a pass of its own, which must give the same bits."""
    n = 200
    layout, inputs, pool = _gdn_case(hk, hv, dk, dv, [n], [[]], dtype, False, seed=dk + cut)
    monkeypatch.setattr(TorchBackend, "gdn_prefill", None)  # the native path must run
    whole, whole_pool = _gdn_run(CpuBackend(), layout, inputs, pool)
    first, mid_pool = _gdn_run(CpuBackend(), _layout([cut], [[]]), [t[:cut] for t in inputs], pool)
    rest, end_pool = _gdn_run(
        CpuBackend(), _layout([n - cut], [[]]), [t[cut:] for t in inputs], mid_pool
    )
    assert torch.equal(torch.cat([first, rest]), whole)
    assert torch.equal(end_pool, whole_pool)
    assert not torch.equal(mid_pool[5], whole_pool[5])  # the resumed call did move the state


def test_native_gdn_scan_snapshot_control(monkeypatch):
    """The snapshot after 40 tokens is not the state after 41 (far beyond the tolerance met
    above), and the final state does not depend on where snapshots are taken."""
    case = (16, 16, 128, 128)
    layout, inputs, pool = _gdn_case(*case, [80], [[40]], torch.bfloat16, True, seed=2)
    later, _, _ = _gdn_case(*case, [80], [[41]], torch.bfloat16, True, seed=2)
    monkeypatch.setattr(TorchBackend, "gdn_prefill", None)
    out40, at40 = _gdn_run(CpuBackend(), layout, inputs, pool)
    out41, at41 = _gdn_run(CpuBackend(), later, inputs, pool)
    assert (at40[8] - at41[8]).abs().max() > 100 * 2e-4 * at40[8].abs().mean()
    assert torch.equal(at40[5], at41[5]) and torch.equal(out40, out41)


@pytest.mark.parametrize(
    "channels,width,activation,bias,dtype",
    [
        (1792 + 256, 4, "silu", True, torch.bfloat16),  # Granite-4.0-H-350M's xBC
        (6144, 4, "silu", False, torch.bfloat16),  # Qwen3.5-0.8B's q|k|v
        (1024, 3, None, False, torch.bfloat16),  # LFM2-350M's short conv
        (40, 4, "silu", True, torch.bfloat16),  # 8 channels past the 16-lane vectors: the loop
        (37, 2, "silu", True, torch.float32),  # fp32, odd channels, width 2
        (50, 4, "silu", True, torch.float32),  # fp32: the portable loop, 32 lanes, then 18
        (24, 9, "silu", True, torch.bfloat16),  # a width no published model has: 8 taps carried
    ],
)
def test_native_conv_prefill_matches_the_reference(channels, width, activation, bias, dtype,
                                                   monkeypatch):  # fmt: skip
    """The cpu backend's one-pass conv prefill against the torch reference over several
    segments with row-strided inputs: outputs equal (bf16: the same two roundings), every final
    and snapshot state equal, including snapshots before K-1 tokens (carried-in inputs)."""
    g = torch.Generator().manual_seed(channels)
    lens, snaps = [150, 64, 3], [[1, 64, 100, 150], [2, 2], [1, 3]]
    layout = _layout(lens, snaps)
    T = sum(lens)
    x = torch.randn(T, channels + 100, generator=g).to(dtype)[:, 50 : 50 + channels]
    w = (torch.randn(channels, width, generator=g) * 0.4).to(dtype)
    b = torch.randn(channels, generator=g).to(dtype) if bias else None
    pool = torch.randn(64, channels, width - 1, generator=g).to(dtype)

    def run(backend):
        p = pool.clone()
        return backend.conv1d_prefill(x, w, b, p, layout, activation), p

    want, want_pool = run(TorchBackend())
    monkeypatch.setattr(TorchBackend, "conv1d_prefill", None)  # the native path must run
    got, got_pool = run(CpuBackend())
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got_pool, want_pool)
    diff = (got.float() - want.float()).abs()
    if dtype == torch.float32:
        assert diff.max() <= 1e-6 * want.float().abs().max()
        return
    # bf16: the same two roundings, but the fp32 sum of bias and taps in torch's order, which
    # follows the CPU's kernels: the same bits on AVX512-BF16 machines; on an AVX2 EPYC 2 of
    # 446k outputs one bf16 step apart, at sums that nearly cancel. So: at most one step
    # anywhere, and almost every output equal (a wrong window or state moves most outputs).
    step = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0**-126))) - 7)
    assert (diff <= step).all()
    assert (diff > 0).float().mean() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_conv_prefills_silu_saturates_as_torchs(dtype, monkeypatch):
    """Pre-activations far below -88 (inputs of ~1e30): the SiLU is ~0 as torch's is, in the
    16-lane vectors and the loop past them (40 channels). Before silu_poly, exp_poly's clamp at
    88 gave x / e^88 there (~-6e-9 at -1e30), which this fails."""
    g = torch.Generator().manual_seed(1)
    lens = [70, 9]
    x = (torch.randn(sum(lens), 40, generator=g) * 1e30).to(dtype)
    w = (torch.rand(40, 4, generator=g) + 0.1).to(dtype)
    pool = torch.zeros(64, 40, 3, dtype=dtype)
    layout = _layout(lens, [[], []])
    want = TorchBackend().conv1d_prefill(x, w, None, pool.clone(), layout, "silu")
    assert (want.float() < -1e20).sum() == 0 and (x.float() < -1e29).sum() > 1000
    monkeypatch.setattr(TorchBackend, "conv1d_prefill", None)  # the native path must run
    got = CpuBackend().conv1d_prefill(x, w, None, pool.clone(), layout, "silu")
    low = want.float() <= 0
    assert low.sum() > 1000 and (got.float()[low].abs() <= 1e-30).all()
    tol = (2**-7 if dtype == torch.bfloat16 else 1e-6) * want.float().abs().max()
    assert ((got[~low].float() - want[~low].float()).abs() <= tol).all()


def test_native_conv_prefill_snapshot_control(monkeypatch):
    """The state after 40 tokens is not the state after 41 (so the equality above is not
    vacuous), and neither is the carried-in state."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 64, generator=g).bfloat16()
    w = torch.randn(64, 4, generator=g).bfloat16()
    pool = torch.randn(64, 64, 3, generator=g).bfloat16()
    monkeypatch.setattr(TorchBackend, "conv1d_prefill", None)
    states = []
    for n in (40, 41):
        p = pool.clone()
        CpuBackend().conv1d_prefill(x, w, None, p, _layout([80], [[n]]), "silu")
        states.append(p)
    assert not torch.equal(states[0][8], states[1][8])
    assert not torch.equal(states[0][8], pool[8]) and torch.equal(states[0][5], states[1][5])
