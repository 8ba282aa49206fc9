"""Gated DeltaNet on fla-core's kernels (``kernels/triton/gdn.py``) against the torch reference
(``kernels/gated_delta.py``): varlen prefill segments (5, 70 and 130 tokens: under a chunk,
over one, over two) from zero and non-zero states, GVA, snapshots at chunk boundaries
and at a segment's end checked against the reference run over the segment cut there, the whole
pool compared (rows nobody writes must not change); decode steps in place by slot; fp32 and bf16
activations, fp32 and bf16 pools; negative controls (wrong state slots, a dropped snapshot).

Without a GPU the kernels run on CPU tensors under the interpreter (``conftest.py``). The bf16
cases rely on the shim computing bf16 on values (``interpreter.py``: unpatched, fla's bf16 chunked
forward returned ~1e9); what it does not emulate: the GPU's order of fp32 sums and TF32, which a
GPU uses for fla's fp32 ``tl.dot`` (hence the looser fp32 tolerance there, ``FP32_TOL``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from mambaradix.kernels import gated_delta as reference
from mambaradix.kernels.triton import gdn
from mambaradix.kernels.triton.gdn import CHUNK_SIZE, GdnChunks, snapshot_index

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32, of the largest value: the interpreter's matmuls are exact fp32 (measured ~1e-6); a GPU
# runs fla's fp32 dots in TF32 (H200, measured: up to 1.2e-3)
FP32_TOL = 2e-5 if DEVICE == "cpu" else 3e-3
BF16_ULPS = 3  # bf16: in ulps of the compared tensor's largest value (measured: up to 1.5)


@dataclass
class Case:
    lens: list[int]
    hk: int = 1
    hv: int = 2  # GVA: value heads share key heads
    dk: int = 32
    dv: int = 32
    dtype: torch.dtype = torch.float32  # activations
    pool_dtype: torch.dtype = torch.float32
    pool_size: int = 12
    snapshots: tuple[tuple[int, int], ...] = ()  # (segment, new tokens)
    zero_states: tuple[int, ...] = ()  # segments starting from a zero state
    seed: int = 0


def _inputs(case: Case):
    """Activations as the layer hands them over (g fp32 from the gates, beta in the activations'
    dtype), a pool of random states, the segments' slots and the snapshot slots (distinct)."""
    gen = torch.Generator().manual_seed(case.seed)
    T = sum(case.lens)
    q = torch.randn(T, case.hk, case.dk, generator=gen).to(case.dtype)
    k = torch.randn(T, case.hk, case.dk, generator=gen).to(case.dtype)
    v = torch.randn(T, case.hv, case.dv, generator=gen).to(case.dtype)
    g = F.logsigmoid(1.5 * torch.randn(T, case.hv, generator=gen) + 4.0)  # decays 0.9 .. 1
    beta = torch.sigmoid(torch.randn(T, case.hv, generator=gen)).to(case.dtype)
    pool = torch.randn(case.pool_size, case.hv, case.dk, case.dv, generator=gen)
    perm = torch.randperm(case.pool_size, generator=gen)
    n = len(case.lens)
    slots, snap_slots = perm[:n], perm[n : n + len(case.snapshots)]
    for p in case.zero_states:
        pool[slots[p]] = 0
    return (q, k, v, g, beta), pool.to(case.pool_dtype), slots, snap_slots


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _reference(case: Case, acts, pool, slots, snap_slots):
    """Per segment, the reference chunked rule in fp32 on the same (rounded) inputs: the output,
    and the pool it leaves (the final state in the segment's slot, each snapshot the final state
    of the segment cut to its length)."""
    cu = _cu(case.lens).tolist()
    out = torch.empty(sum(case.lens), case.hv, case.dv)
    want = pool.clone()

    def run(p: int, n: int):
        a = cu[p]
        x = [t[a : a + n].float().unsqueeze(0) for t in acts]
        return reference.chunk_gated_delta_rule(*x, pool[slots[p]].float().unsqueeze(0))

    for p, n in enumerate(case.lens):
        o, final = run(p, n)
        out[cu[p] : cu[p] + n] = o[0]
        want[slots[p]] = final[0].to(pool.dtype)
    for (p, n), slot in zip(case.snapshots, snap_slots):
        want[slot] = run(p, n)[1][0].to(pool.dtype)
    return out, want


def _prefill(case: Case, acts, pool, slots, snap_slots, snapshots=None, with_chunks=True):
    """The kernel on DEVICE (snapshot ``j`` of ``snapshots``, the case's by default, into
    ``snap_slots[j]``); returns (o, pool after) on the CPU."""
    snapshots = case.snapshots if snapshots is None else snapshots
    srcs = torch.tensor([snapshot_index(case.lens, p, n) for p, n in snapshots], dtype=torch.long)
    dev_pool = pool.to(DEVICE, copy=True)  # never the caller's pool (on the CPU, .to is a no-op)
    o = gdn.gdn_prefill(
        *(t.to(DEVICE) for t in acts),
        dev_pool,
        _cu(case.lens).to(DEVICE),
        slots.to(DEVICE),
        srcs.to(DEVICE),
        snap_slots.to(DEVICE),
        GdnChunks.build(case.lens, DEVICE) if with_chunks else None,
    )
    return o.cpu(), dev_pool.cpu()


def _ulp(t: torch.Tensor) -> float:
    """One bf16 ulp at the tensor's largest magnitude."""
    top = t.float().abs().max().item()
    return 2.0 ** (torch.tensor(top).log2().floor().item() - 7) if top > 0 else 0.0


def _tol(want: torch.Tensor, dtype: torch.dtype) -> float:
    if dtype == torch.bfloat16:
        return BF16_ULPS * _ulp(want)
    return FP32_TOL * max(1.0, want.abs().max().item())


def _problems(case: Case, got, want, touched: torch.Tensor) -> list[str]:
    """What differs: ``o`` beyond tolerance, a written pool row beyond tolerance (``slot s``), or
    any change to a row nobody writes (``stray s``)."""
    (o, pool), (o_ref, pool_ref) = got, want
    problems = []
    if o.dtype != case.dtype or (o.float() - o_ref).abs().max() > _tol(o_ref, case.dtype):
        problems.append("o")
    state_dtype = torch.bfloat16 if torch.bfloat16 in (case.dtype, case.pool_dtype) else None
    for s in range(pool.shape[0]):
        if s in touched.tolist():
            err = (pool[s].float() - pool_ref[s].float()).abs().max()
            if err > _tol(pool_ref[s].float(), state_dtype or torch.float32):
                problems.append(f"slot {s}")
        elif not torch.equal(pool[s], pool_ref[s]):
            problems.append(f"stray {s}")
    return problems


# (activations, pool): the fp32 path, bf16 activations into an fp32 pool, all bf16
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
]
LENS = [5, 70, 130]  # under a chunk, over one, over two
SNAPS = ((1, 64), (2, 64), (2, 128), (1, 70))  # the last: a segment's end


@pytest.mark.parametrize(
    "dtype,pool_dtype",
    DTYPES,
    ids=["fp32", "bf16-act", "bf16-pool"],
)
def test_prefill_matches_reference(dtype, pool_dtype):
    case = Case(LENS, dtype=dtype, pool_dtype=pool_dtype, snapshots=SNAPS, zero_states=(1,))
    acts, pool, slots, snap_slots = _inputs(case)
    # the last case lets fla derive the chunk numbering from cu_seqlens itself
    got = _prefill(case, acts, pool, slots, snap_slots, with_chunks=pool_dtype == torch.float32)
    touched = torch.cat([slots, snap_slots])
    assert _problems(case, got, _reference(case, acts, pool, slots, snap_slots), touched) == []


def test_prefill_negative_controls():
    """Reading the wrong slots and dropping a snapshot are both caught, by name."""
    case = Case([70, 5], snapshots=((0, 64), (1, 5)))
    acts, pool, slots, snap_slots = _inputs(case)
    want = _reference(case, acts, pool, slots, snap_slots)
    wrong = slots.roll(1)
    got = _prefill(case, acts, pool, wrong, snap_slots[1:], snapshots=case.snapshots[1:])
    problems = _problems(case, got, want, torch.cat([slots, snap_slots]))
    assert "o" in problems
    assert f"slot {snap_slots[0].item()}" in problems  # the dropped snapshot: its row unwritten
    assert all(f"slot {s}" in problems for s in slots.tolist())


def test_snapshot_is_the_truncated_runs_final_state_in_fp32():
    """bf16 activations into an fp32 pool: a chunk-boundary snapshot carries the state at fp32,
    equal to the final state (fp32 from fla) of the same segment cut there; fla's own ``h`` is in
    the activations' dtype, which this would catch. And a snapshot at the end of a segment whose
    length is a multiple of the chunk is that segment's final state."""
    full = Case([70], dtype=torch.bfloat16, snapshots=((0, 64),), pool_size=4)
    acts, pool, slots, snap_slots = _inputs(full)
    _, after = _prefill(full, acts, pool, slots, snap_slots)
    # the same segment cut to 64 tokens, from the same state (slot 2), snapshot at its end (3)
    cut = Case([64], dtype=torch.bfloat16, snapshots=((0, 64),), pool_size=4)
    cut_pool = pool.clone()
    cut_pool[2] = pool[slots[0]]
    cut_acts = [t[:64] for t in acts]
    _, cut_after = _prefill(cut, cut_acts, cut_pool, torch.tensor([2]), torch.tensor([3]))
    snap = after[snap_slots[0]]
    assert torch.allclose(snap, cut_after[2], rtol=1e-6, atol=1e-6)
    assert not torch.equal(snap, snap.bfloat16().float())  # not a bf16 value widened
    assert torch.equal(cut_after[3], cut_after[2])


def test_snapshot_index_numbers_fla_chunks():
    lens = [5, 70, 130, 64]  # chunks 1, 2, 3, 1: NT = 7
    assert snapshot_index(lens, 0, 0) == 0  # the state a segment starts from
    assert snapshot_index(lens, 1, 64) == 2
    assert [snapshot_index(lens, 2, n) for n in (0, 64, 128)] == [3, 4, 5]
    assert snapshot_index(lens, 1, 70) == 7 + 1  # a segment's end: its final state
    assert snapshot_index(lens, 3, 64) == 7 + 3  # a chunk boundary that is the end: final
    for seg, n in ((1, 32), (1, 71), (2, -64)):
        with pytest.raises(ValueError, match="multiples of 64"):
            snapshot_index(lens, seg, n)
    from fla.ops.utils import prepare_chunk_indices, prepare_chunk_offsets

    chunks = GdnChunks.build(lens, "cpu")
    cu = _cu(lens).long()
    assert torch.equal(chunks.indices.long(), prepare_chunk_indices(cu, CHUNK_SIZE))
    assert torch.equal(chunks.offsets.long(), prepare_chunk_offsets(cu, CHUNK_SIZE))


# ---------------------------------------------------------------------------- decode


def _decode_case(dtype, pool_dtype, batch=3, steps=3, hk=1, hv=2, dk=32, dv=32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(8, hv, dk, dv, generator=gen).to(pool_dtype)
    slots = torch.randperm(8, generator=gen)[:batch]
    steps_in = []
    for _ in range(steps):
        q = torch.randn(batch, hk, dk, generator=gen).to(dtype)
        k = torch.randn(batch, hk, dk, generator=gen).to(dtype)
        v = torch.randn(batch, hv, dv, generator=gen).to(dtype)
        g = F.logsigmoid(1.5 * torch.randn(batch, hv, generator=gen) + 4.0)
        beta = torch.sigmoid(torch.randn(batch, hv, generator=gen)).to(dtype)
        steps_in.append((q, k, v, g, beta))
    return pool, slots, steps_in


def _decode_reference(pool, slots, steps_in):
    want, outs = pool.clone(), []
    for q, k, v, g, beta in steps_in:
        o, new = reference.recurrent_gated_delta_step(
            q.float(), k.float(), v.float(), g, beta.float(), want[slots].float()
        )
        want[slots] = new.to(pool.dtype)
        outs.append(o)
    return outs, want


def _decode(pool, slots, steps_in):
    dev_pool, outs = pool.to(DEVICE, copy=True), []
    for x in steps_in:
        o = gdn.gdn_decode(*(t.to(DEVICE) for t in x), dev_pool, slots.to(DEVICE))
        outs.append(o.cpu())
    return outs, dev_pool.cpu()


def _decode_problems(got, want, slots, dtype, pool_dtype) -> list[str]:
    (outs, pool), (ref_outs, ref_pool) = got, want
    problems = [
        f"o{i}"
        for i, (o, r) in enumerate(zip(outs, ref_outs))
        if o.dtype != dtype or (o.float() - r).abs().max() > _tol(r, dtype)
    ]
    state_dtype = torch.bfloat16 if torch.bfloat16 in (dtype, pool_dtype) else torch.float32
    for s in range(pool.shape[0]):
        if s in slots.tolist():
            r = ref_pool[s].float()
            if (pool[s].float() - r).abs().max() > _tol(r, state_dtype):
                problems.append(f"slot {s}")
        elif not torch.equal(pool[s], ref_pool[s]):
            problems.append(f"stray {s}")
    return problems


@pytest.mark.parametrize(
    "dtype,pool_dtype",
    DTYPES,
    ids=["fp32", "bf16-act", "bf16-pool"],
)
def test_decode_matches_reference(dtype, pool_dtype):
    """Three steps in a row, each reading and writing the pool rows in place by slot."""
    pool, slots, steps_in = _decode_case(dtype, pool_dtype)
    got = _decode(pool, slots, steps_in)
    want = _decode_reference(pool, slots, steps_in)
    assert _decode_problems(got, want, slots, dtype, pool_dtype) == []


def test_decode_negative_control():
    pool, slots, steps_in = _decode_case(torch.float32, torch.float32, steps=1)
    want = _decode_reference(pool, slots, steps_in)
    wrong = slots.roll(1)
    problems = _decode_problems(_decode(pool, wrong, steps_in), want, slots, *[torch.float32] * 2)
    assert "o0" in problems and all(f"slot {s}" in problems for s in slots.tolist())


def test_decode_refuses_a_pool_with_strided_rows():
    pool = torch.zeros(2, 4, 32, 64, device=DEVICE)[..., :32]  # rows of [4, 32, 32], strided
    q = torch.zeros(1, 1, 32, device=DEVICE)
    v, g = torch.zeros(1, 4, 32, device=DEVICE), torch.zeros(1, 4, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        gdn.gdn_decode(q, q, v, g, g, pool, torch.zeros(1, dtype=torch.long, device=DEVICE))


# ---------------------------------------------------------------------------- several positions


def _positions_case(dtype, pool_dtype, widths=(1, 3, 2), hk=1, hv=2, dk=32, dv=32, seed=2):
    """Requests of ``widths`` positions (a verify step): the state after each row but a
    request's last goes into a snapshot slot of its own, after its last into its working slot."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(12, hv, dk, dv, generator=gen).to(pool_dtype)
    order = torch.randperm(12, generator=gen).tolist()
    slots, spare = order[: len(widths)], order[len(widths) :]
    cu, row_slots = [0], []
    for slot, w in zip(slots, widths):
        cu.append(cu[-1] + w)
        row_slots += [spare.pop() for _ in range(w - 1)] + [slot]
    T = cu[-1]
    rows = (
        torch.randn(T, hk, dk, generator=gen).to(dtype),
        torch.randn(T, hk, dk, generator=gen).to(dtype),
        torch.randn(T, hv, dv, generator=gen).to(dtype),
        F.logsigmoid(1.5 * torch.randn(T, hv, generator=gen) + 4.0),
        torch.sigmoid(torch.randn(T, hv, generator=gen)).to(dtype),
    )
    return pool, torch.tensor(slots), torch.tensor(cu), torch.tensor(row_slots), rows


def _positions_reference(pool, slots, cu, row_slots, rows):
    """Position after position, each reading the state the one before stored (in the pool's
    dtype), as the one-position decode steps do."""
    want, outs = pool.clone(), torch.empty(rows[2].shape)
    for i, slot in enumerate(slots.tolist()):
        src = slot
        for r in range(cu[i], cu[i + 1]):
            q, k, v, g, beta = (t[r : r + 1].float() for t in rows)
            o, new = reference.recurrent_gated_delta_step(q, k, v, g, beta, want[src : src + 1])
            outs[r] = o[0]
            src = int(row_slots[r])
            want[src] = new[0].to(pool.dtype)
    return outs, want


def _positions(pool, slots, cu, row_slots, rows):
    dev_pool = pool.to(DEVICE, copy=True)
    index = (t.to(DEVICE, torch.int32) for t in (slots, cu, row_slots))
    o = gdn.gdn_decode_positions(*(t.to(DEVICE) for t in rows), dev_pool, *index)
    return o.cpu(), dev_pool.cpu()


@pytest.mark.parametrize("dtype,pool_dtype", DTYPES, ids=["fp32", "bf16-act", "bf16-pool"])
def test_decode_of_several_positions_matches_stepping(dtype, pool_dtype):
    """A verify step's rows through the multi-position kernel equal the one-position steps
    taken in order: outputs, every row's state in its slot, no other slot touched."""
    pool, slots, cu, row_slots, rows = _positions_case(dtype, pool_dtype)
    (o, got), (want_o, want) = (
        _positions(pool, slots, cu, row_slots, rows),
        _positions_reference(pool, slots, cu, row_slots, rows),
    )
    assert o.dtype == dtype and (o.float() - want_o).abs().max() <= _tol(want_o, dtype)
    state_dtype = torch.bfloat16 if torch.bfloat16 in (dtype, pool_dtype) else torch.float32
    touched = set(row_slots.tolist())
    for s in range(pool.shape[0]):
        if s in touched:
            assert (got[s].float() - want[s].float()).abs().max() <= _tol(
                want[s].float(), state_dtype
            ), s
        else:
            assert torch.equal(got[s], pool[s]), s


def test_decode_of_several_positions_negative_controls():
    """Rows' slots shifted among a request's rows, or states carried in from the wrong slots,
    fail the checks above."""
    pool, slots, cu, row_slots, rows = _positions_case(torch.float32, torch.float32)
    want_o, want = _positions_reference(pool, slots, cu, row_slots, rows)
    o, _ = _positions(pool, slots.roll(1), cu, row_slots, rows)
    assert (o - want_o).abs().max() > 1e-2
    swapped = row_slots.clone()
    swapped[[1, 2]] = swapped[[2, 1]]  # the second request's two snapshot slots swapped
    _, got = _positions(pool, slots, cu, swapped, rows)
    assert not torch.allclose(got[int(row_slots[1])], want[int(row_slots[1])], atol=1e-3)


# ---------------------------------------------------------------------------- GPU / real size


@pytest.mark.skipif(DEVICE != "cuda", reason="host syncs are a GPU matter")
def test_no_host_sync():
    """Neither op reads device data on the host (given ``GdnChunks``); the mode is live: a host
    read in it raises."""
    case = Case(LENS, dtype=torch.bfloat16, snapshots=SNAPS)
    acts, pool, slots, snap_slots = _inputs(case)
    _prefill(case, acts, pool, slots, snap_slots)  # autotuning syncs: done here, once
    dec_pool, dec_slots, steps_in = _decode_case(torch.bfloat16, torch.float32, steps=1)
    _decode(dec_pool, dec_slots, steps_in)
    srcs = torch.tensor([snapshot_index(case.lens, p, n) for p, n in SNAPS])
    prefill = [t.to(DEVICE) for t in (*acts, pool, _cu(case.lens), slots, srcs, snap_slots)]
    chunks = GdnChunks.build(case.lens, DEVICE)
    decode = [t.to(DEVICE) for t in (*steps_in[0], dec_pool, dec_slots)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gdn.gdn_prefill(*prefill, chunks)
        gdn.gdn_decode(*decode)
        with pytest.raises(RuntimeError):
            prefill[0].sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_decode_replays_in_a_cuda_graph():
    pool, slots, steps_in = _decode_case(torch.bfloat16, torch.float32, steps=3)
    want = _decode(pool, slots, steps_in)
    dev_pool, dev_slots = pool.to(DEVICE), slots.to(DEVICE)
    static = [t.to(DEVICE) for t in steps_in[0]]
    gdn.gdn_decode(*static, dev_pool.clone(), dev_slots)  # warm: compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn.gdn_decode(*static, dev_pool, dev_slots)
    dev_pool.copy_(pool.to(DEVICE))  # capture does not run the step
    outs = []
    for x in steps_in:
        for buf, t in zip(static, x):
            buf.copy_(t)
        graph.replay()
        outs.append(out.cpu())
    assert all(torch.equal(a, b) for a, b in zip(outs, want[0]))
    assert torch.equal(dev_pool.cpu(), want[1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_real_head_shapes(dtype):
    """Qwen3-Next / Qwen3.5 heads: Dk = Dv = 128, GVA (here 2 key heads, 4 value heads)."""
    case = Case(
        [1, 200, 64], hk=2, hv=4, dk=128, dv=128, dtype=dtype, pool_size=8,
        snapshots=((1, 64), (1, 192), (2, 64)), zero_states=(2,),
    )  # fmt: skip
    acts, pool, slots, snap_slots = _inputs(case)
    got = _prefill(case, acts, pool, slots, snap_slots)
    touched = torch.cat([slots, snap_slots])
    assert _problems(case, got, _reference(case, acts, pool, slots, snap_slots), touched) == []
    d_pool, d_slots, steps_in = _decode_case(dtype, torch.float32, hk=2, hv=4, dk=128, dv=128)
    got = _decode(d_pool, d_slots, steps_in)
    want = _decode_reference(d_pool, d_slots, steps_in)
    assert _decode_problems(got, want, d_slots, dtype, torch.float32) == []
    verify = _positions_case(dtype, torch.float32, hk=2, hv=4, dk=128, dv=128)
    (o, got), (want_o, want) = _positions(*verify), _positions_reference(*verify)
    assert (o.float() - want_o).abs().max() <= _tol(want_o, dtype)
    assert (got.float() - want.float()).abs().max() <= _tol(want.float(), dtype)
