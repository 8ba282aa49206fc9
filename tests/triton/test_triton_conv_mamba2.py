"""The Triton short conv and Mamba2 scan (``kernels/triton/conv.py``, ``mamba2.py``) against the
torch backend's ops (the reference) on one forward's layout: decodes (one with a snapshot) and
prefills from zero and from carried-in states, one shorter than the conv's K-1, snapshots inside
a chunk, on a chunk boundary, after one token and at the end; a spare slot no op may touch.

The Mamba2 prefill's fully parallel form has its own tests (``test_triton_mamba2_chunked.py``).
Each check compares outputs and whole pools, so a stray
write to another slot fails, and the Mamba2 snapshots are also checked against a token-by-token
recurrence (``mamba2_step``), not only against the reference's chunked scan. Negative controls:
the same checks catch a kernel fed the wrong state slots, one whose snapshots are dropped or
taken from the wrong chunks, a stray write and a state rounded the wrong way.

Without a GPU the kernels run on CPU tensors under the interpreter (``conftest.py``). Its limits
met here: bf16 values are held as ``uint16`` bit patterns (the kernels widen every bf16 load to
fp32 before any arithmetic, so only the fp32 -> bf16 rounding of stores matters, which the shim
makes round to nearest even as a GPU does: ``test_interpreter_rounds_bf16_stores_to_nearest_even``
checks that precondition); and TF32 is not emulated, so the kernels' choice of ``tf32x3`` for
fp32 products (``tf32`` only for ``C B^T`` of bf16 values, exact) is checked at fp32 tolerance
only where the tests run on a GPU. bf16 is tested faithfully: a bf16 output must be the fp32
computation on the same bf16 inputs rounded once (within half a bf16 ulp), a state stored in a
bf16 pool must equal the fp32 pool's state rounded to nearest even, bit for bit, and conv states
(copies of inputs) equal the reference's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from mambaradix.core import ForwardReq
from mambaradix.kernels.mamba2 import mamba2_step, process_dt, split_xbc
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.kernels.triton import conv as triton_conv
from mambaradix.kernels.triton import mamba2 as triton_mamba2
from mambaradix.layout import ForwardLayout, VerifyReq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = 16
SPARE_SLOT = 6  # no request's and no snapshot's: any write to it is a stray one
# (prefix_len, new tokens, snapshots as (n, slot)); decodes first, as the scheduler orders them
REQUESTS = [
    (9, 1, [(1, 12)]),
    (4, 1, []),
    (0, 2, [(1, 13)]),  # from a zero state; a snapshot after one token
    (5, 2, [(1, 14)]),  # carried-in state, shorter than K-1: states mix it with the inputs
    (0, 70, [(32, 15), (33, 11), (70, 10)]),  # a chunk boundary, one past it, the end
    (40, 100, [(1, 9), (64, 8), (99, 7)]),
]
FP32_TOL = 1e-4
HALF_ULP = 2.0**-8  # half a bf16 ulp, relative to the value


def _layout(requests=REQUESTS) -> ForwardLayout:
    """One request per tuple (prefix_len, new tokens, snapshots[, True: a verify step])."""
    reqs = [
        (VerifyReq if verify else ForwardReq)(
            prefix, [1] * n, torch.arange(prefix + n), slot, list(snaps)
        )
        for slot, (prefix, n, snaps, *verify) in enumerate(requests)
    ]
    return ForwardLayout.build(reqs)


def _prefill_index(layout: ForwardLayout, dtype=torch.int32) -> list[torch.Tensor]:
    """cu_seqlens, state_slots, snapshot seqs / offsets / slots on the kernels' device (int32, as
    the cuda backend passes them)."""
    seg = layout.prefill
    tensors = [
        seg.cu_seqlens, seg.state_slots, torch.tensor(seg.snapshot_seqs),
        torch.tensor(seg.snapshot_offsets), seg.snapshot_slots,
    ]  # fmt: skip
    return [t.to(device=DEVICE, dtype=dtype) for t in tensors]


def _pool(gen: torch.Generator, *shape: int, dtype: torch.dtype, layout: ForwardLayout):
    """A pool of random states, zero in the slots of the requests with no prefix."""
    pool = torch.randn(SLOTS, *shape, generator=gen).to(dtype)
    for r in layout.reqs:
        if r.prefix_len == 0:
            pool[r.state_slot] = 0
    return pool


def _dev(*tensors):
    return [t.to(DEVICE) if t is not None else None for t in tensors]


def _differing_slots(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> list:
    """The pool slots where ``got`` departs from ``want`` (empty: the whole pools agree)."""
    got, want = got.cpu().double(), want.cpu().double()
    bad = ((got - want).abs() > atol + rtol * want.abs()).flatten(1).any(1)
    return bad.nonzero().flatten().tolist()


def _half_ulp_off(got: torch.Tensor, want32: torch.Tensor) -> bool:
    """Whether a bf16 ``got`` is NOT the fp32 ``want32`` rounded once (half a bf16 ulp, with
    slack for fp32 sums taken in another order)."""
    err = (got.cpu().double() - want32.cpu().double()).abs()
    return bool((err > HALF_ULP * 1.01 * want32.cpu().double().abs() + 1e-6).any())


# --------------------------------------------------------------------------- conv

K, CONV_C = 4, 40


class ConvCase:
    def __init__(self, dtype=torch.float32, pool_dtype=None, channels=CONV_C, seed=0,
                 requests=REQUESTS) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        self.layout = _layout(requests)
        self.pool = _pool(gen, channels, K - 1, dtype=pool_dtype or dtype, layout=self.layout)
        self.weight = (torch.randn(channels, K, generator=gen) * 0.5).to(dtype)
        self.bias = torch.randn(channels, generator=gen).to(dtype)
        self.x = torch.randn(self.layout.prefill.num_tokens, channels, generator=gen).to(dtype)
        self.x_dec = torch.randn(self.layout.decode.rows.count, channels, generator=gen).to(dtype)

    def reference(self, decode=False, activation="silu", upcast=False):
        """The torch backend's outputs and pool (``upcast``: on fp32 copies of every input)."""
        f = (lambda t: t.float()) if upcast else (lambda t: t)
        pool, ref = f(self.pool.clone()), TorchBackend()
        if decode:
            y = ref.conv1d_decode(f(self.x_dec), f(self.weight), f(self.bias), pool, self.layout,
                                  activation)  # fmt: skip
        else:
            y = ref.conv1d_prefill(f(self.x), f(self.weight), f(self.bias), pool, self.layout,
                                   activation)  # fmt: skip
        return y, pool

    def prefill(self, activation="silu", bias=True, x=None, index=None):
        pool, w, b = _dev(self.pool.clone(), self.weight, self.bias if bias else None)
        x = x if x is not None else self.x.to(DEVICE)
        index = index if index is not None else _prefill_index(self.layout)
        y = triton_conv.conv1d_prefill(x, w, b, pool, *index[:2], *index[2:], activation)
        return y.cpu(), pool.cpu()

    def decode(self, activation="silu", slots=None):
        pool, w, b, x = _dev(self.pool.clone(), self.weight, self.bias, self.x_dec)
        dec = self.layout.decode
        slots = (slots if slots is not None else dec.state_slots).to(DEVICE, torch.int32)
        y = triton_conv.conv1d_decode(x, w, b, pool, slots, activation)
        # the backend's decode snapshots: the updated working slot copied (no host sync)
        src, dst = _dev(dec.snapshot_src, dec.snapshot_slots)
        pool.index_copy_(0, dst, pool.index_select(0, src))
        return y.cpu(), pool.cpu()


def test_interpreter_rounds_bf16_stores_to_nearest_even() -> None:
    """The precondition of the bf16 tests: an fp32 value stored to bf16 rounds to nearest even
    (1 + 3/512 lies nearer 1 + 1/128 than 1; the unpatched interpreter truncated to 1)."""
    x = torch.tensor([[1.0 + 3 / 512]] * 2, dtype=torch.float32, device=DEVICE)
    w = torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16, device=DEVICE)
    pool = torch.zeros(2, 1, 1, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    triton_conv.conv1d_decode(x, w.float(), None, pool, slots, None)
    assert pool.flatten().tolist() == [x[0, 0].to(torch.bfloat16).item()] * 2 == [1.0078125] * 2


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_prefill_fp32(activation) -> None:
    case = ConvCase()
    want_y, want_pool = case.reference(activation=activation)
    got_y, got_pool = case.prefill(activation)
    assert torch.allclose(got_y, want_y, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_pool, want_pool)  # states are copies of inputs: exact
    assert not torch.equal(got_pool, case.pool)  # (the op wrote something)


def test_conv_prefill_bf16() -> None:
    case = ConvCase(torch.bfloat16)
    got_y, got_pool = case.prefill()
    want_y, want_pool = case.reference()
    assert torch.equal(got_pool, want_pool)
    exact_y, _ = case.reference(upcast=True)
    assert not _half_ulp_off(got_y, exact_y)
    # against the reference's own bf16 (rounded after the conv and after the SiLU): 2 ulps
    assert torch.allclose(got_y.float(), want_y.float(), atol=0, rtol=2.0**-6)


def test_conv_mixed_dtypes_round_like_the_reference() -> None:
    """bf16 inputs over an fp32 pool (states are bf16 values), and fp32 inputs over a bf16 pool
    (every stored state rounded to the pool's dtype)."""
    case = ConvCase(torch.bfloat16, pool_dtype=torch.float32)
    got_y, got_pool = case.prefill()
    want_y, want_pool = case.reference()
    assert torch.equal(got_pool, want_pool)
    case = ConvCase(torch.float32, pool_dtype=torch.bfloat16)
    got_y, got_pool = case.prefill()
    want_y, want_pool = case.reference()
    assert torch.equal(got_pool, want_pool)
    assert torch.allclose(got_y, want_y, atol=1e-5, rtol=1e-5)


def test_conv_prefill_strided_input_and_int64_index() -> None:
    """x as a column slice of a wider projection (the layers pass views), no bias, and the
    layout's own int64 index tensors."""
    case = ConvCase()
    wide = torch.randn(case.x.shape[0], CONV_C + 24)
    wide[:, 8 : 8 + CONV_C] = case.x
    x = wide.to(DEVICE)[:, 8 : 8 + CONV_C]
    got_y, got_pool = case.prefill(bias=False, x=x, index=_prefill_index(case.layout, torch.long))
    case.bias = torch.zeros_like(case.bias)
    want_y, want_pool = case.reference()
    assert torch.allclose(got_y, want_y, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_pool, want_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv_decode(dtype) -> None:
    case = ConvCase(dtype)
    got_y, got_pool = case.decode()
    want_y, want_pool = case.reference(decode=True)
    assert torch.equal(got_pool, want_pool)
    if dtype == torch.float32:
        assert torch.allclose(got_y, want_y, atol=1e-5, rtol=1e-5)
    else:
        assert not _half_ulp_off(got_y, case.reference(decode=True, upcast=True)[0])


def test_conv_negative_controls() -> None:
    """Wrong state slots, dropped snapshots and a stray write each fail the pool check."""
    case = ConvCase()
    want_y, want_pool = case.reference()
    index = _prefill_index(case.layout)
    wrong = index[:1] + [index[1].roll(1)] + index[2:]
    got_y, got_pool = case.prefill(index=wrong)
    assert not torch.allclose(got_y, want_y, atol=1e-3)
    assert _differing_slots(got_pool, want_pool, 0, 0)
    empty = torch.empty(0, dtype=torch.int32, device=DEVICE)
    _, got_pool = case.prefill(index=index[:2] + [empty] * 3)
    snaps = sorted(case.layout.prefill.snapshot_slots.tolist())
    assert _differing_slots(got_pool, want_pool, 0, 0) == snaps
    _, got_pool = case.prefill()
    got_pool[SPARE_SLOT, 0, 0] += 1
    assert _differing_slots(got_pool, want_pool, 0, 0) == [SPARE_SLOT]
    _, got_pool = case.decode(slots=case.layout.decode.state_slots.flip(0))
    assert _differing_slots(got_pool, case.reference(decode=True)[1], 0, 0)


# --------------------------------------------------------------------------- Mamba2


class Mamba2Case:
    """Random Mamba2 inputs: ``H`` heads of ``P`` in ``G`` groups, state size ``N``; the prefill's
    x, B, C as views of one conv output row (as ``split_xbc`` hands them to the layer)."""

    def __init__(self, shape=(4, 16, 2, 16), dtype=torch.float32, pool_dtype=torch.float32,
                 seed=0, requests=REQUESTS) -> None:  # fmt: skip
        H, P, G, N = self.shape = shape
        gen = torch.Generator().manual_seed(seed)
        self.layout = _layout(requests)
        # bf16-valued states, so an fp32 pool and a bf16 pool start from the same ones
        self.pool = _pool(gen, H, P, N, dtype=torch.bfloat16, layout=self.layout) * 0.3
        self.pool = self.pool.to(pool_dtype)
        self.A = -torch.rand(H, generator=gen) - 0.1
        self.D = torch.randn(H, generator=gen).to(dtype)
        self.inputs = []
        for n in (self.layout.prefill.num_tokens, self.layout.decode.rows.count):
            xbc = torch.randn(n, H * P + 2 * G * N, generator=gen).to(dtype)
            dt = process_dt(torch.randn(n, H, generator=gen), torch.zeros(H))
            self.inputs.append((*split_xbc(xbc, shape), dt))

    def reference(self, decode=False):
        x, B, C, dt = self.inputs[decode]
        pool, ref = self.pool.clone(), TorchBackend()
        op = ref.mamba2_decode if decode else ref.mamba2_prefill
        return op(x, dt, self.A, B, C, self.D, pool, self.layout), pool

    def prefill(self, index=None, D=True):
        x, B, C, dt = _dev(*self.inputs[0])
        pool, A, D = _dev(self.pool.clone(), self.A, self.D if D else None)
        index = index if index is not None else _prefill_index(self.layout)
        y = triton_mamba2.mamba2_prefill(x, dt, A, B, C, D, pool, *index)
        return y.cpu(), pool.cpu()

    def decode(self, slots=None):
        x, B, C, dt = _dev(*self.inputs[1])
        pool, A, D = _dev(self.pool.clone(), self.A, self.D)
        dec = self.layout.decode
        slots = (slots if slots is not None else dec.state_slots).to(DEVICE, torch.int32)
        y = triton_mamba2.mamba2_decode(x, dt, A, B, C, D, pool, slots)
        src, dst = _dev(dec.snapshot_src, dec.snapshot_slots)
        pool.index_copy_(0, dst, pool.index_select(0, src))
        return y.cpu(), pool.cpu()

    def stepped_snapshots(self) -> dict[int, torch.Tensor]:
        """Every prefill snapshot slot's state by a token-by-token recurrence (fp32)."""
        x, B, C, dt = self.inputs[0]
        seg, out = self.layout.prefill, {}
        for p, slot in enumerate(seg.state_slots.tolist()):
            state = self.pool[slot : slot + 1].float().clone()  # mamba2_step works in place
            wanted = {n: s for q, n, s in zip(seg.snapshot_seqs, seg.snapshot_offsets,
                                               seg.snapshot_slots.tolist()) if q == p}  # fmt: skip
            for i in range(seg.lens[p]):
                t = seg.cu_list[p] + i
                rows = slice(t, t + 1)
                _, state = mamba2_step(state, x[rows], dt[rows], self.A, B[rows], C[rows], None)
                if i + 1 in wanted:
                    out[wanted[i + 1]] = state[0].clone()
        return out


def _mamba2_failures(got, want, y_tol=FP32_TOL, state_tol=1e-5) -> list[str]:
    (got_y, got_pool), (want_y, want_pool) = got, want
    failures = []
    scale = float(want_y.abs().max())
    if not torch.allclose(got_y, want_y, atol=y_tol * scale, rtol=y_tol):
        failures.append("y")
    failures += [f"slot {s}" for s in _differing_slots(got_pool, want_pool, state_tol, state_tol)]
    return failures


def test_mamba2_prefill_fp32() -> None:
    case = Mamba2Case()
    got, want = case.prefill(), case.reference()
    assert got[0].dtype == torch.float32
    assert _mamba2_failures(got, want) == []
    stepped = case.stepped_snapshots()
    assert sorted(stepped) == sorted(case.layout.prefill.snapshot_slots.tolist())
    for slot, state in stepped.items():
        assert torch.allclose(got[1][slot], state, atol=1e-5, rtol=1e-5), slot


def test_mamba2_prefill_bf16_inputs_and_pools() -> None:
    """bf16 x, B, C, D: y (fp32) as tight as fp32; a bf16 pool holds exactly the fp32 pool's
    states rounded to nearest even, and y does not change (the running state is never rounded)."""
    case = Mamba2Case(dtype=torch.bfloat16)
    got32, want = case.prefill(), case.reference()
    assert _mamba2_failures(got32, want) == []
    case.pool = case.pool.to(torch.bfloat16)
    got16 = case.prefill()
    assert got16[1].dtype == torch.bfloat16
    assert torch.equal(got16[0], got32[0])
    assert torch.equal(got16[1], got32[1].to(torch.bfloat16))
    # against the reference's bf16 pool: both round fp32 states ~1e-6 apart, so 1 ulp
    assert _differing_slots(got16[1], case.reference()[1], 1e-6, 2.0**-7) == []


def test_mamba2_prefill_odd_shapes_without_D() -> None:
    """P and N off the block sizes (masked lanes), one group, no D, no snapshots."""
    requests = [(0, 1, []), (3, 1, []), (0, 37, []), (2, 5, [])]
    case = Mamba2Case(shape=(3, 24, 1, 20), requests=requests, seed=1)
    case.D = None
    got, want = case.prefill(D=False), case.reference()
    assert _mamba2_failures(got, want) == []


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mamba2_decode(pool_dtype) -> None:
    case = Mamba2Case(dtype=torch.bfloat16, pool_dtype=pool_dtype)
    got, want = case.decode(), case.reference(decode=True)
    if pool_dtype == torch.float32:
        assert _mamba2_failures(got, want) == []
    else:  # y from the fp32 state as tight as fp32; stored states 1 ulp (see above)
        assert torch.allclose(got[0], want[0], atol=1e-5, rtol=FP32_TOL)
        assert _differing_slots(got[1], want[1], 1e-6, 2.0**-7) == []


def test_mamba2_negative_controls() -> None:
    """Wrong state slots, dropped snapshots, a stray write and states truncated (not rounded)
    to bf16 each fail the checks above."""
    case = Mamba2Case()
    want = case.reference()
    index = _prefill_index(case.layout)
    wrong = case.prefill(index=index[:1] + [index[1].roll(1)] + index[2:])
    assert "y" in _mamba2_failures(wrong, want)
    empty = torch.empty(0, dtype=torch.int32, device=DEVICE)
    dropped = case.prefill(index=index[:2] + [empty] * 3)
    snaps = sorted(case.layout.prefill.snapshot_slots.tolist())
    assert _mamba2_failures(dropped, want) == [f"slot {s}" for s in snaps]
    y, pool = case.prefill()
    pool[SPARE_SLOT, 0, 0, 0] += 1e-3
    assert _mamba2_failures((y, pool), want) == [f"slot {SPARE_SLOT}"]
    truncated = (pool.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(truncated, pool.to(torch.bfloat16))
    wrong_decode = case.decode(slots=case.layout.decode.state_slots.flip(0))
    assert _mamba2_failures(wrong_decode, case.reference(decode=True))


# verify steps (a snapshot after each position but the last) beside a one-position decode and
# a prefill; the second verify also copies its state after its last position
VERIFY_REQUESTS = [
    (9, 1, [(1, 12)]),
    (40, 4, [(1, 10), (2, 11), (3, 13)], True),
    (20, 3, [(1, 14), (2, 15), (3, 9)], True),
    (0, 5, []),
]


@pytest.mark.parametrize(
    "dtype, pool_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
     (torch.bfloat16, torch.bfloat16)],
    ids=["fp32", "bf16-pool", "bf16"],
)  # fmt: skip
def test_decodes_of_several_positions_equal_stepping(dtype, pool_dtype) -> None:
    """A verify step's rows through the conv and Mamba2 decode kernels (one program walking
    its request's rows) equal the reference's one-position steps taken in order, with every
    position's state in its slot; with a bf16 pool under fp32 activations each position reads
    what the one before stored, so the conv's pools are bit-equal there too."""
    from mambaradix.kernels.cuda_backend import CudaBackend

    conv = ConvCase(dtype, pool_dtype=pool_dtype, requests=VERIFY_REQUESTS)
    pool, w, b, x = _dev(conv.pool.clone(), conv.weight, conv.bias, conv.x_dec)
    y = CudaBackend(DEVICE).conv1d_decode(x, w, b, pool, conv.layout, "silu")
    want_y, want_pool = conv.reference(decode=True)
    assert torch.equal(pool.cpu(), want_pool)
    if dtype == torch.float32:
        assert torch.allclose(y.cpu(), want_y, atol=1e-5, rtol=1e-5)
    else:  # rounded once (the reference rounds twice), as test_conv_decode
        assert not _half_ulp_off(y.cpu(), conv.reference(decode=True, upcast=True)[0])
    case = Mamba2Case(dtype=dtype, pool_dtype=pool_dtype, requests=VERIFY_REQUESTS)
    x, B, C, dt = _dev(*case.inputs[1])
    pool, A, D = _dev(case.pool.clone(), case.A, case.D)
    y = CudaBackend(DEVICE).mamba2_decode(x, dt, A, B, C, D, pool, case.layout)
    got = (y.cpu(), pool.cpu())
    if pool_dtype == torch.float32:
        assert _mamba2_failures(got, case.reference(decode=True)) == []
    else:  # states rounded to bf16 at every position: 1 ulp
        want_y, want_pool = case.reference(decode=True)
        assert torch.allclose(got[0], want_y, atol=1e-4, rtol=1e-3)
        assert _differing_slots(got[1], want_pool, 1e-6, 2.0**-7) == []


# --------------------------------------------------------------------------- real shapes

REAL_SHAPES = {  # (H, P, G, N): published_configs.py
    "granite_4_0_h_350m": (24, 64, 1, 128),
    "nemotron_h_8b": (128, 64, 8, 128),
}
REAL_REQUESTS = [(9, 1, [(1, 12)]), (0, 40, [(32, 13), (40, 14)]), (40, 70, [(1, 15), (64, 11)])]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, dtype",
    [("granite_4_0_h_350m", torch.float32), ("granite_4_0_h_350m", torch.bfloat16),
     ("nemotron_h_8b", torch.bfloat16)],
    ids=str,
)  # fmt: skip
def test_real_shapes(model, dtype) -> None:
    """Both ops at a real model's Mamba2 and conv widths (conv channels H*P + 2*G*N); ~2 min
    interpreted, the Nemotron-H case most of it."""
    H, P, G, N = shape = REAL_SHAPES[model]
    case = Mamba2Case(shape=shape, dtype=dtype, requests=REAL_REQUESTS)
    assert _mamba2_failures(case.prefill(), case.reference()) == []
    assert _mamba2_failures(case.decode(), case.reference(decode=True)) == []
    conv = ConvCase(dtype, channels=H * P + 2 * G * N, requests=REAL_REQUESTS)
    for decode in (False, True):
        got_y, got_pool = conv.decode() if decode else conv.prefill()
        assert torch.equal(got_pool, conv.reference(decode)[1])
        assert not _half_ulp_off(got_y, conv.reference(decode, upcast=True)[0])
