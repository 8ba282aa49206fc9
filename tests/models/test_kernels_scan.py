"""The native Mamba2 prefill scan (``cpu.mamba2_scan``, the cpu backend's ``mamba2_prefill``)
against the torch chunked scan, at published shapes and at shapes off its vector path."""

from __future__ import annotations

import shutil

import pytest
import torch

from mambaradix.core import ForwardReq
from mambaradix.kernels import native
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.mamba2 import process_dt, split_xbc
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layout import ForwardLayout

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or not native.available(),
    reason="no C compiler: the native kernels cannot be built here",
)


def _case(shape, lens, snapshots, dtype, channel_major, seed):
    """A prefill layout of segments ``lens`` (state slots 5, 1, 3, ...; ``snapshots[i]`` the
    offsets segment i snapshots, into slots from 8 up), and the scan's inputs as views of one
    conv output (channel-major as the prefill conv leaves it, or token-major)."""
    H, P, G, N = shape
    g = torch.Generator().manual_seed(seed)
    slot_of = [5, 1, 3, 0][: len(lens)]
    spare = iter(range(8, 64))
    reqs = [
        ForwardReq(
            0, list(range(n)), torch.arange(n), slot_of[i], [(k, next(spare)) for k in snapshots[i]]
        )
        for i, n in enumerate(lens)
    ]
    layout = ForwardLayout.build(reqs)
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
