"""The fully parallel Mamba2 prefill (``kernels/triton/mamba2_chunked.py``) against the torch
backend's op (the reference), checked as the sequential kernel is in ``test_triton_conv_mamba2.py``
(outputs, whole pools, snapshots against a token-by-token recurrence, bf16 pools rounded once),
on a layout whose snapshots fall where the ``cuda`` backend declares them (a multiple of 64 new
tokens, or a segment's end); the backend's choice between the two forms. Negative controls:
wrong state slots, snapshots taken from shifted or neighbouring chunks. Run by the interpreter
where no GPU is (``conftest.py``), which does not emulate TF32: the kernels' fp32 products ask
for ``tf32x3`` (about fp32 accuracy) and ``C B^T`` of bf16 values for one TF32 pass (exact), so
the fp32 tolerances here hold on a GPU only if those choices do, which the device script's run
of these tests checks."""

from __future__ import annotations

import pytest
import torch
from test_triton_conv_mamba2 import (
    DEVICE,
    REAL_SHAPES,
    Mamba2Case,
    _dev,
    _mamba2_failures,
    _prefill_index,
)

from mambaradix.kernels.triton import mamba2 as triton_mamba2
from mambaradix.kernels.triton import mamba2_chunked

# snapshots where the cuda backend declares them (multiples of 64 of new tokens, or the end):
# a chunk's start state, a segment's final state, one long segment of several chunks after
# carried-in states, and one shorter than a chunk
CHUNKED_REQUESTS = [
    (9, 1, [(1, 12)]),
    (0, 2, [(2, 13)]),
    (5, 70, [(64, 14)]),
    (40, 200, [(64, 15), (128, 11), (200, 10)]),
    (0, 64, [(64, 9)]),
]


def _chunked_prefill(case, snap_chunks=None, slots=None, D=True):
    from mambaradix.kernels.triton import gdn

    seg = case.layout.prefill
    x, B, C, dt = _dev(*case.inputs[0])
    pool, A, D = _dev(case.pool.clone(), case.A, case.D if D else None)
    chunks = gdn.GdnChunks.build(seg.lens, DEVICE)
    if snap_chunks is None:
        snap_chunks = torch.tensor(
            [gdn.snapshot_index(seg.lens, s, n)
             for s, n in zip(seg.snapshot_seqs, seg.snapshot_offsets)],
        )  # fmt: skip
    cu, state_slots, _, _, snap_slots = _prefill_index(case.layout)
    if slots is not None:
        state_slots = slots.to(DEVICE, torch.int32)
    y = mamba2_chunked.mamba2_prefill_chunked(
        x, dt, A, B, C, D, pool, cu, state_slots, snap_chunks.to(DEVICE), snap_slots,
        chunks.indices, chunks.offsets,
    )  # fmt: skip
    return y.cpu(), pool.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba2_chunked_prefill(dtype) -> None:
    """The fully parallel form against the reference (outputs, whole pools) and its snapshots
    against a token-by-token recurrence; with bf16 inputs and pools as the sequential kernel."""
    case = Mamba2Case(dtype=dtype, requests=CHUNKED_REQUESTS, seed=2)
    got, want = _chunked_prefill(case), case.reference()
    assert _mamba2_failures(got, want) == []
    for slot, state in case.stepped_snapshots().items():
        assert torch.allclose(got[1][slot], state, atol=1e-5, rtol=1e-5), slot
    # the sequential kernel on the same forward: the same outputs within fp32 rounding
    assert _mamba2_failures(got, case.prefill()) == []
    if dtype == torch.bfloat16:
        case.pool = case.pool.to(torch.bfloat16)
        got16 = _chunked_prefill(case)
        assert torch.equal(got16[0], got[0])
        assert torch.equal(got16[1], got[1].to(torch.bfloat16))


def test_mamba2_chunked_prefill_odd_shapes_without_D() -> None:
    """P and N off the block sizes, one group, no D, no snapshots."""
    requests = [(0, 1, []), (0, 130, []), (2, 65, [])]
    case = Mamba2Case(shape=(3, 24, 1, 20), requests=requests, seed=3)
    case.D = None
    got, want = _chunked_prefill(case, D=False), case.reference()
    assert _mamba2_failures(got, want) == []


def test_mamba2_chunked_negative_controls() -> None:
    """Wrong state slots, snapshots from the wrong chunks, and dropped snapshots each fail."""
    case = Mamba2Case(requests=CHUNKED_REQUESTS, seed=2)
    want = case.reference()
    seg = case.layout.prefill
    wrong = _chunked_prefill(case, slots=seg.state_slots.roll(1))
    assert "y" in _mamba2_failures(wrong, want)
    from mambaradix.kernels.triton import gdn

    right = torch.tensor([gdn.snapshot_index(seg.lens, s, n)
                          for s, n in zip(seg.snapshot_seqs, seg.snapshot_offsets)])  # fmt: skip
    shifted = _chunked_prefill(case, snap_chunks=right.roll(1))
    assert _mamba2_failures(shifted, want)
    off_by_one = (right + 1).clamp(max=gdn.snapshot_index(seg.lens, len(seg.lens) - 1,
                                                          seg.lens[-1]))  # fmt: skip
    assert _mamba2_failures(_chunked_prefill(case, snap_chunks=off_by_one), want)


def test_the_backend_takes_the_chunked_prefill_for_few_long_segments(monkeypatch) -> None:
    """The rule (``prefers_chunked``) and the backend's routing by it, per forward."""
    from mambaradix.kernels.cuda_backend import CudaBackend

    granite, nemotron = (24, 64, 128), (128, 64, 128)  # heads, P, N
    assert mamba2_chunked.prefers_chunked(1, 128, *granite, 132)  # one 8k prompt
    assert not mamba2_chunked.prefers_chunked(1, 2, *granite, 132)  # a short one
    assert not mamba2_chunked.prefers_chunked(64, 128 * 64, *granite, 132)  # the GPU is full
    # Nemotron-H-8B: 512 programs for one prompt; its 2k-token prompt's chunk states (134 MB)
    # fit the scratch bound, an 8k one's (537 MB) do not
    assert mamba2_chunked.prefers_chunked(1, 32, *nemotron, 132)
    assert not mamba2_chunked.prefers_chunked(1, 128, *nemotron, 132)
    taken = []
    for module, form in ((triton_mamba2, "mamba2_prefill"),
                         (mamba2_chunked, "mamba2_prefill_chunked")):  # fmt: skip
        monkeypatch.setattr(module, form, lambda *a, form=form: taken.append(form))
    for requests, form in (
        ([(5, 1, []), (0, 300, [])], "mamba2_prefill_chunked"),
        ([(5, 1, []), (0, 100, []), (3, 100, [])], "mamba2_prefill"),
    ):
        case = Mamba2Case(requests=requests)
        backend = CudaBackend(DEVICE)
        backend.prepare(case.layout)
        x, B, C, dt = case.inputs[0]
        backend.mamba2_prefill(x, dt, case.A, B, C, case.D, case.pool, case.layout)
        assert taken.pop() == form


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_real_shapes_chunked(dtype) -> None:
    """The fully parallel Mamba2 prefill at Granite-4.0-H-350M's heads, snapshots on chunk
    starts and ends."""
    case = Mamba2Case(shape=REAL_SHAPES["granite_4_0_h_350m"], dtype=dtype,
                      requests=CHUNKED_REQUESTS, seed=4)  # fmt: skip
    assert _mamba2_failures(_chunked_prefill(case), case.reference()) == []
