"""Decodes of several positions (a speculative verify step, ``layout.VerifyReq``) on the ``cpu``
backend's native decode kernels (``csrc/decode.h``): one C call steps each request's positions
in order, the state after each written into its position's slot. It must give, bit for bit in
fp32 and bf16, what the one-position kernels give when run position after position with each
state carried into the next slot by hand: every output row and every pool (each position's
slot, the working slot, every other slot untouched), for the Gated DeltaNet step (with and
without its output norm), the conv step (kernel widths 3 and 4: the bf16 vector window and the
scalar loop), Mamba2's scan step and its fused decode step (with its norm). The reference
backend's own verify path (position after position) is held to the backend contract
(``test_backend_contract.py``); a chain that does not carry the state from one position to
the next fails here (negative control)."""

from __future__ import annotations

import shutil

import pytest
import torch

from mambaradix.core import ForwardReq
from mambaradix.kernels import native
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.norm import GatedNorm
from mambaradix.layout import ForwardLayout, VerifyReq

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)

SLOTS = 20
# a plain decode in slot 0; verifies of 4 and 2 positions in slots 1 and 2 (the second also
# copies its last state to slot 9), their positions' slots 5-7 and 8; slots 10+ are nobody's
REQS = [
    ForwardReq(9, [1], torch.arange(10), 0),
    VerifyReq(20, [1] * 4, torch.arange(30, 54), 1, [(1, 5), (2, 6), (3, 7)], all_logits=True),
    VerifyReq(5, [1] * 2, torch.arange(60, 67), 2, [(1, 8), (2, 9)], all_logits=True),
]
# the rows above in order: (row, working slot, slot the state comes from, slot it goes to)
CHAIN = [(0, 0, 0, 0), (1, 1, 1, 5), (2, 1, 5, 6), (3, 1, 6, 7), (4, 1, 7, 1), (5, 2, 2, 8),
         (6, 2, 8, 2)]  # fmt: skip
COPIES = [(2, 9)]  # snapshots no row writes: (from, to) after the step


def _one(slot: int) -> ForwardLayout:
    return ForwardLayout.build([ForwardReq(0, [1], torch.arange(1), slot)])


def _rows(rows: list[torch.Tensor | None], row: int) -> list[torch.Tensor | None]:
    return [None if t is None else t[row : row + 1] for t in rows]


def _chained(op, pools: list[torch.Tensor], rows: list, carry: bool = True) -> torch.Tensor:
    """``op(pools, *row inputs, layout)`` as one-position decodes, row after row, each state
    carried into the row's slot first (``carry`` False: each position starts from its working
    slot's state as it was before the step, what a kernel that does not carry states from one
    position to the next computes: the negative control)."""
    start = [pool.clone() for pool in pools]
    outs = []
    for row, work, src, dst in CHAIN:
        for pool, s in zip(pools, start):
            pool[dst] = pool[src] if carry else s[work]
        outs.append(op(pools, *_rows(rows, row), _one(dst)))
    for src, dst in COPIES:
        for pool in pools:
            pool[dst] = pool[src]
    return torch.cat(outs)


def _check(op, pools: list[torch.Tensor], rows: list) -> None:
    """The verify layout in one call equals its rows one by one, outputs and pools."""
    layout = ForwardLayout.build(REQS)
    assert layout.prefill is None and layout.decode.widths == [1, 4, 2]
    assert layout.decode.row_slots.tolist() == [dst for _, _, _, dst in CHAIN]
    multi = [p.clone() for p in pools]
    got = op(multi, *rows, layout)
    chain = [p.clone() for p in pools]
    want = _chained(op, chain, rows)
    assert torch.equal(got, want)
    for a, b, before in zip(multi, chain, pools):
        assert torch.equal(a, b)
        assert torch.equal(a[10:], before[10:])  # nobody's slots untouched
        assert not torch.equal(a[5], a[6]) and not torch.equal(a[6], a[7])  # positions differ
    wrong = [p.clone() for p in pools]
    assert not torch.equal(_chained(op, wrong, rows, carry=False), want)


def _rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.fixture(autouse=True)
def _native_here():
    if not native.available():
        pytest.skip("no C compiler here: the cpu backend runs the reference")


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dk", [32, 128])  # 128: Qwen3.5's heads, the C code's unrolled case
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_deltanet_verify_equals_its_positions_one_by_one(dtype, norm, dk):
    g = torch.Generator().manual_seed(1)
    hk, hv, dv, K = 2, 4, dk, 4
    C, T = 2 * hk * dk + hv * dv, 7
    conv_pool = _rand(g, SLOTS, C, K - 1, dtype=dtype)
    ssm_pool = _rand(g, SLOTS, hv, dk, dv, dtype=torch.float32, scale=0.1)
    w, b = _rand(g, C, K, dtype=dtype, scale=0.5), _rand(g, C, dtype=dtype)
    # x, z, a, b as row-strided views of one projection, as the layer has them
    x, z, a, bb = _rand(g, T, C + hv * dv + 2 * hv, dtype=dtype).split([C, hv * dv, hv, hv], 1)
    A_log, dt_bias = _rand(g, hv, dtype=dtype), _rand(g, hv, dtype=dtype)
    weight = (1 + _rand(g, dv, dtype=torch.float32, scale=0.2)).to(dtype)
    be = CpuBackend()

    def op(pools, x, a, bb, z, layout):
        gn = GatedNorm(z, weight, 1e-6, dv) if norm else None
        return be.gdn_decode(x, a, bb, *pools, layout, w, b, A_log, dt_bias, hk, "silu", gn)

    _check(op, [conv_pool, ssm_pool], [x, a, bb, z])


@pytest.mark.parametrize("K", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_verify_equals_its_positions_one_by_one(dtype, K):
    g = torch.Generator().manual_seed(2)
    C = 72  # four 16-channel vectors and a scalar tail in bf16
    pool = _rand(g, SLOTS, C, K - 1, dtype=dtype)
    w, b = _rand(g, C, K, dtype=dtype, scale=0.5), _rand(g, C, dtype=dtype)
    x = _rand(g, 7, C + 5, dtype=dtype)[:, 2 : 2 + C]
    be = CpuBackend()

    def op(pools, x, layout):
        return be.conv1d_decode(x, w, b, pools[0], layout, "silu")

    _check(op, [pool], [x])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_scan_step_verify_equals_its_positions_one_by_one(dtype):
    g = torch.Generator().manual_seed(3)
    H, P, G, N = 4, 32, 2, 16
    pool = _rand(g, SLOTS, H, P, N, dtype=torch.float32, scale=0.1)
    xbc = _rand(g, 7, H * P + 2 * G * N, dtype=dtype)
    x, B, C = xbc.split([H * P, G * N, G * N], dim=1)
    x, B, C = x.view(7, H, P), B.view(7, G, N), C.view(7, G, N)
    dt, A = torch.rand(7, H, generator=g), -torch.rand(H, generator=g)
    D = _rand(g, H, dtype=dtype)
    be = CpuBackend()

    def op(pools, x, dt, B, C, layout):
        return be.mamba2_decode(x, dt, A, B, C, D, pools[0], layout)

    _check(op, [pool], [x, dt, B, C])


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_decode_verify_equals_its_positions_one_by_one(dtype, norm):
    g = torch.Generator().manual_seed(4)
    H, P, G, N, K = 4, 32, 2, 16, 4
    C = H * P + 2 * G * N
    conv_pool = _rand(g, SLOTS, C, K - 1, dtype=dtype)
    ssm_pool = _rand(g, SLOTS, H, P, N, dtype=torch.float32, scale=0.1)
    w, b = _rand(g, C, K, dtype=dtype, scale=0.3), _rand(g, C, dtype=dtype)
    gate, xbc, dt_raw = _rand(g, 7, H * P + C + H, dtype=dtype).split([H * P, C, H], dim=1)
    A_log, dt_bias, D = (_rand(g, H, dtype=dtype, scale=0.5) for _ in range(3))
    weight = (1 + _rand(g, H * P, dtype=torch.float32, scale=0.2)).to(dtype)
    be = CpuBackend()

    def op(pools, xbc, dt_raw, gate, layout):
        gn = GatedNorm(gate, weight, 1e-6, H * P // G) if norm else None
        return be.mamba2_mixer_decode(
            xbc, dt_raw, *pools, layout, w, b, "silu", A_log, dt_bias, (0.0, float("inf")), D,
            (H, P, G, N), gn,
        )  # fmt: skip

    _check(op, [conv_pool, ssm_pool], [xbc, dt_raw, gate])


def test_the_native_kernels_run_the_verify_without_falling_back(monkeypatch):
    """The verify above runs in the C kernels: the reference's position-after-position path
    (``TorchBackend._stepwise``) is never taken."""
    from mambaradix.kernels.torch_backend import TorchBackend

    def refuse(*args, **kwargs):
        raise AssertionError("the cpu backend stepped a verify position by position")

    monkeypatch.setattr(TorchBackend, "_stepwise", refuse)
    for dtype in DTYPES:
        test_gated_deltanet_verify_equals_its_positions_one_by_one(dtype, True, 32)
        test_conv_verify_equals_its_positions_one_by_one(dtype, 4)
        test_mamba2_scan_step_verify_equals_its_positions_one_by_one(dtype)
        test_mamba2_decode_verify_equals_its_positions_one_by_one(dtype, True)


@pytest.fixture(params=[0, 1], ids=["unblocked", "blocked"])
def rows_blocked(request):
    """``csrc/linear.c``'s K blocks (``rows_blocked``, chosen by the CPU's L1d size) forced off
    and on, so that both loops are tested on every CPU with the bf16 dot product."""
    lib = native.load("linear")
    if lib is None:
        yield request.param
        return
    got = lib.linear_rows_blocked(request.param)
    assert got == (request.param and lib.linear_uses_dpbf16())
    try:
        yield request.param
    finally:
        lib.linear_rows_blocked(-1)


@pytest.mark.parametrize("m", [3, 4, 7, 16])
@pytest.mark.parametrize("k", [1000, 1024, 2049, 3584])
def test_linear_of_verify_rows_equals_each_row_alone(k, m, rows_blocked):
    """A verify step's rows go through the linears as one small batch (``csrc/linear.c``: x
    packed chunk-major for groups of 3-4 rows; with K >= 2,048 and the rows over 16 KB, K in
    blocks with the sums carried between them, ``rows_blocked``, forced on and off here): each
    row's output is, bit for bit, the row's alone (a K tail, an odd number of weight rows, a
    bias); and the gated MLP of the rows is its composition (Qwen3.5-0.8B's widths). Control: a
    changed weight row changes its column."""
    from mambaradix.kernels import cpu
    from mambaradix.kernels.torch_backend import TorchBackend

    g = torch.Generator().manual_seed(k + m)
    x = _rand(g, m, k, dtype=torch.bfloat16)
    w = _rand(g, 301, k, dtype=torch.bfloat16, scale=0.05)
    b = _rand(g, 301, dtype=torch.bfloat16)
    whole = cpu.linear(x, w, b)
    for i in range(m):
        assert torch.equal(cpu.linear(x[i : i + 1], w, b)[0], whole[i])
    w2 = w.clone()
    w2[17] = w2[18]
    changed = cpu.linear(x, w2, b) != whole
    assert changed[:, 17].all() and not changed[:, torch.arange(301) != 17].any()
    if k == 1024:
        gate_up = _rand(g, 2 * 3584, 1024, dtype=torch.bfloat16, scale=0.05)
        down = _rand(g, 1024, 3584, dtype=torch.bfloat16, scale=0.05)
        fused = cpu.gated_mlp(x, gate_up, down, "silu")
        assert fused is not None
        assert torch.equal(fused, TorchBackend.gated_mlp(CpuBackend(), x, gate_up, down, "silu"))
