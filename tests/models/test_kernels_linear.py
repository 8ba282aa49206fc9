"""The native bf16 linear (``csrc/linear.c``: the rows kernel for decode batches of up to
``LINEAR_NATIVE_MAX_ROWS`` rows, the tile kernel for 12-127 rows where fp32 arithmetic is
chosen) against float64 truth and torch's bf16 matmul at the projection shapes of the real-size
presets, with a tolerance a bf16-accumulating kernel fails (negative control); the two kernels
give the same bits, so a row's result does not depend on the batch around it; larger batches,
fp32 and other layouts take torch's matmul unchanged. On a CPU with AMX, with the AMX kernel
turned off (it has tests of its own)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mambaradix.kernels import bf16_matmul, cpu, native
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layers.ops import Linear

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)


def tiles_built() -> bool:
    """Whether this build has the tile kernel (AVX512-BF16: ``vdpbf16ps``, whose sums it
    reproduces). Without it, 12-127 rows stay with the rows kernel (up to
    ``LINEAR_NATIVE_MAX_ROWS``) or torch's matmul."""
    from mambaradix.kernels import native

    lib = native.load("linear")
    return lib is not None and bool(lib.linear_uses_dpbf16())


NO_TILES = "the tile kernel needs AVX512-BF16 (vdpbf16ps), which this CPU lacks"
needs_tiles = pytest.mark.skipif(shutil.which("cc") is not None and not tiles_built(),
                                 reason=NO_TILES)  # fmt: skip

# (in, out): Granite-4.0-H-350M's Mamba2 in/out projections, its MLP, Qwen3.5-0.8B's MLP
# down projection, a K with a tail of 8 (not a multiple of 32) and an N that is odd, a K with
# a tail of 3 (not a multiple of 8: the AVX2 kernel's zero-padded last chunk)
SHAPES = [(768, 3352), (1536, 768), (2048, 768), (3584, 1024), (200, 131), (203, 67)]


def make(m: int, k: int, n: int, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = (torch.randn(n, generator=g) * 0.1).bfloat16() if bias else None
    return x, w, b


def err_in_ulps(got: torch.Tensor, x, w, b) -> torch.Tensor:
    """|got - truth| in bf16 spacings of the truth, with a floor at 2^-9 of the sum of |x w|
    (below it the bf16 output carries no information a kernel could get right)."""
    truth = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T
    mag = torch.maximum(truth.abs(), scale * 2.0**-9)
    spacing = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    return (got.double() - truth).abs() / spacing


def bf16_accumulated(x, w) -> torch.Tensor:
    """A kernel that keeps its running sum in bf16 (the negative control)."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    xf, wf = x.float(), w.float()
    for i in range(x.shape[1]):
        acc = (acc.float() + xf[:, i : i + 1] * wf[:, i]).bfloat16()
    return acc


def on_two_and(threads: int, run):
    """``run()`` on 2 threads, then on ``threads``; torch's thread count restored after."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = run()
        torch.set_num_threads(threads)
        return want, run()
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def dot_product_kernels():
    """These tests are the dot-product kernels' (rows, tiles): on a CPU with AMX they run with
    the tile unit's kernel turned off (``tests/models/test_kernels_amx.py`` tests that one)."""
    was = cpu.uses_amx()
    cpu.set_amx(False)
    try:
        yield
    finally:
        cpu.set_amx(was)


@pytest.fixture
def no_torch_matmul(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("fell back to torch's matmul")

    monkeypatch.setattr(cpu.F, "linear", refuse)


@pytest.fixture
def matmul_mode(monkeypatch):
    """Set ``kernels.bf16_matmul``'s path for one test; the process's choice comes back after."""
    saved = bf16_matmul._choice
    monkeypatch.delenv("MAMBARADIX_BF16_MATMUL", raising=False)
    yield bf16_matmul.set_mode
    bf16_matmul._choice = saved


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize(
    "m, kernel", [(1, "rows"), (3, "rows"), (8, "rows"), (16, "rows"), (12, "tiles"), (45, "tiles")]
)
def test_native_linear_against_truth_and_torch(k, n, m, kernel, matmul_mode, monkeypatch):
    if kernel == "tiles" and not tiles_built():
        pytest.skip(NO_TILES)
    x, w, b = make(m, k, n, seed=k + n + m, bias=m in (3, 45))
    want = F.linear(x, w, b)  # torch's bf16 matmul (fp32 accumulation too)
    matmul_mode("fp32" if kernel == "tiles" else "bf16")  # (tiles where fp32 arithmetic wins)
    monkeypatch.setattr(cpu, "LINEAR_NATIVE_X_BYTES", 1 << 40)  # the kernel at every shape
    monkeypatch.setattr(cpu.F, "linear", lambda *a: pytest.fail("fell back to torch"))
    tiled = []
    real_scratch = cpu._tile_scratch
    monkeypatch.setattr(cpu, "_tile_scratch", lambda *a: tiled.append(1) or real_scratch(*a))
    got = cpu.linear(x, w, b)
    assert tiled == ([1] if kernel == "tiles" else [])
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = err_in_ulps(got, x, w, b)
    # fp32 sums, one rounding to bf16: half a spacing plus the sums' own error
    assert err.max() <= 1.0 and err.mean() <= 0.3, (err.max(), err.mean())
    assert err_in_ulps(want, x, w, b).max() <= 1.0  # the same bound holds for torch
    assert (got.float() - want.float()).abs().max() <= 2 * (want.float().abs().max() * 2**-8)
    if b is None and m == 1 and k >= 768:
        bad = err_in_ulps(bf16_accumulated(x, w), x, w, b)
        assert bad.max() > 1.0 or bad.mean() > 0.3  # the bound catches bf16 accumulation


def test_native_path_runs_for_decode_batches(matmul_mode, no_torch_matmul):
    matmul_mode("bf16")
    for m in range(1, cpu.LINEAR_NATIVE_MAX_ROWS + 1):
        x, w, _ = make(m, 768, 64, seed=m)
        assert cpu.linear(x, w, None).shape == (m, 64)
    x, w, _ = make(2, 768, 64, seed=9)
    assert cpu.linear(x.view(2, 1, 768), w, None).shape == (2, 1, 64)  # leading dims kept


def test_a_row_does_not_depend_on_its_batch(matmul_mode, no_torch_matmul):
    matmul_mode("bf16")
    x, w, b = make(cpu.LINEAR_NATIVE_MAX_ROWS, 1000, 300, seed=5, bias=True)  # a tail of 8
    whole = cpu.linear(x, w, b)
    for i in range(x.shape[0]):
        alone = cpu.linear(x[i : i + 1], w, b)
        assert torch.equal(alone[0], whole[i])  # bit for bit, whatever the grouping
    pair = cpu.linear(x[3:5], w, b)
    assert torch.equal(pair, whole[3:5])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_row_does_not_depend_on_the_thread_count(threads, no_torch_matmul):
    """Each thread reads its block of weight rows as two streams (halves side by side, an odd
    row last): the output is the same bit for bit whatever the blocks, for one x row (both
    halves in one pass) and for five (a group of four, then one). Control: the check sees a
    single changed weight row."""
    x, w, b = make(5, 1000, 301, seed=11, bias=True)  # 301 rows: odd blocks on 1 and 3 threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = cpu.linear(x, w, b), cpu.linear(x[:1], w, b)
        torch.set_num_threads(threads)
        got = cpu.linear(x, w, b), cpu.linear(x[:1], w, b)
        w2 = w.clone()
        w2[150] = w2[150].roll(1)  # the row where the halves of the 2-thread blocks meet
        changed = cpu.linear(x[:1], w2, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[1][0], want[0][0])
    diff = (changed != got[1]).nonzero()[:, 1].unique().tolist()
    assert diff == [150]


def test_strided_rows(no_torch_matmul):
    wide = make(4, 1000, 1, seed=2)[0]
    x = wide[:, 100:868]  # rows 1,000 apart, 768 dense
    _, w, _ = make(1, 768, 96, seed=3)
    assert x.stride(0) == 1000
    assert torch.equal(cpu.linear(x, w, None), cpu.linear(x.contiguous(), w, None))


def test_other_inputs_take_torchs_matmul(matmul_mode):
    matmul_mode("bf16")  # (no tile kernel: it runs where fp32 arithmetic is chosen)
    x, w, b = make(cpu.LINEAR_NATIVE_MAX_ROWS + 1, 768, 64, seed=4, bias=True)
    assert torch.equal(cpu.linear(x, w, b), F.linear(x, w, b))  # a prefill-sized batch
    wide = make(8, 3584, 32, seed=6)  # 8 rows of 3,584: beyond what the kernel keeps in L1
    assert torch.equal(cpu.linear(wide[0], wide[1], None), F.linear(wide[0], wide[1]))
    xf, wf = x.float(), w.float()
    assert torch.equal(cpu.linear(xf[:2], wf, None), F.linear(xf[:2], wf))  # fp32
    wt = w.T.contiguous().T  # a transposed weight: not the dense [out, in] the kernel reads
    assert torch.equal(cpu.linear(x[:2], wt, None), F.linear(x[:2], wt))


def test_linear_module_goes_through_its_backend(monkeypatch):
    torch.manual_seed(0)
    lin = Linear(768, 64, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 768).bfloat16()
    lin.bind_ops(TorchBackend())
    ref = lin(x)
    assert torch.equal(ref, F.linear(x, lin.weight, lin.bias))
    monkeypatch.setattr(cpu.F, "linear", lambda *a: pytest.fail("fell back to torch"))
    lin.bind_ops(CpuBackend())
    got = lin(x)  # the C kernel (torch's matmul now refuses)
    assert (got.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2**-7


@pytest.mark.parametrize(
    "hidden,inter,m,mode",  # (16 rows of 4,608: 147 KB of rows, under the 160 KB rows take)
    [
        (768, 2048, 1, "bf16"),
        (768, 2048, 2, "bf16"),
        (1024, 4608, 1, "bf16"),
        (1024, 3584, 1, "bf16"),
        (1024, 3584, 2, "bf16"),
        (1024, 4608, 16, "bf16"),
        (768, 2048, 11, "bf16"),
        (1024, 4608, 16, "fp32"),  # the tile kernel from 12 rows
        (768, 2048, 37, "fp32"),
        (64, 40, 3, "bf16"),  # an intermediate that is no multiple of the activation's chunks
        (64, 100, 2, "fp32"),
    ],
)
def test_gated_mlp_is_the_composition_bit_for_bit(hidden, inter, m, mode, matmul_mode):
    """The cpu backend's one-call gated MLP (Granite-4.0-H-350M's, LFM2-350M's and
    Qwen3.5-0.8B's widths) gives exactly the composition of its own linear, SiLU and product,
    in bf16; the C path runs (cpu.gated_mlp is not None), with either kernel. Control: another
    down projection gives other outputs."""
    if m > cpu.LINEAR_NATIVE_MAX_ROWS and not tiles_built():
        pytest.skip(NO_TILES)
    matmul_mode(mode)
    g = torch.Generator().manual_seed(inter + m)
    x = torch.randn(m, hidden, generator=g).bfloat16()
    gate_up = (torch.randn(2 * inter, hidden, generator=g) * 0.05).bfloat16()
    down = (torch.randn(hidden, inter, generator=g) * 0.05).bfloat16()
    fused = cpu.gated_mlp(x, gate_up, down, "silu")
    assert fused is not None and fused.shape == (m, hidden)
    composed = TorchBackend.gated_mlp(CpuBackend(), x, gate_up, down, "silu")
    assert torch.equal(fused, composed)
    assert torch.equal(CpuBackend().gated_mlp(x, gate_up, down, "silu"), composed)
    other = cpu.gated_mlp(x, gate_up, down.roll(1, dims=0), "silu")
    assert not torch.equal(other, fused)
    if m == 16:  # the other kernel, the same bits
        matmul_mode("fp32" if mode == "bf16" else "bf16")
        assert torch.equal(cpu.gated_mlp(x, gate_up, down, "silu"), fused)


def test_gated_mlp_falls_back_to_the_composition(matmul_mode):
    """Inputs the C code does not cover (fp32, another activation, a prefill-sized batch) get
    None from cpu.gated_mlp and the composition from the backend."""
    matmul_mode("bf16")  # (64 rows would take the tile kernel where fp32 arithmetic is chosen)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g).bfloat16()
    gate_up = torch.randn(512, 128, generator=g).bfloat16()
    down = torch.randn(128, 256, generator=g).bfloat16()
    for args in ((x, gate_up, down, "silu"), (x[:1].float(), gate_up.float(), down.float(),
                 "silu"), (x[:1], gate_up, down, "gelu")):  # fmt: skip
        assert cpu.gated_mlp(*args) is None
        got = CpuBackend().gated_mlp(*args)
        a, b = F.linear(args[0], args[1]).chunk(2, dim=-1)
        act = F.gelu if args[3] == "gelu" else F.silu
        want = F.linear(act(a) * b, args[2])
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_the_blocks_silu_equals_torchs_on_every_bf16_gate():
    """gated_mlp_bf16's activation on all 65,536 bf16 gate values (one row, one-hot x, so the
    gate|up row it computes holds the gate_up weight's first column exactly; read back from its
    scratch): torch's ``silu(gate) * up`` bit for bit down to gate = -88. Below, where e^-gate
    leaves the exponent's range, both are within 1e-36 of zero (torch -0 or ~-5e-37, ours -0)
    where exp_poly's clamp alone gave up to 5.7 (gate = -3e38: x / e^88); NaN stays NaN, and
    gate = -inf gives 0, SiLU's limit (torch NaN from -inf / inf). Control: the product taken
    unrounded after the SiLU differs from torch's."""
    lib = native.load("linear")
    if lib is None:
        pytest.skip("the native linear kernels did not build here")
    n, hidden = 65536, 16
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    up = torch.linspace(-3, 3, n).bfloat16()[order]
    gate_up = torch.zeros(2 * n, hidden, dtype=torch.bfloat16)
    gate_up[:, 0] = torch.cat([gates, up])
    down = torch.zeros(hidden, n, dtype=torch.bfloat16)
    x = torch.zeros(1, hidden, dtype=torch.bfloat16)
    x[0, 0] = 1
    gu, h, out = (torch.empty(1, k, dtype=torch.bfloat16) for k in (2 * n, n, hidden))
    lib.gated_mlp_bf16(
        1, n, hidden, x.data_ptr(), hidden, gate_up.data_ptr(), down.data_ptr(), gu.data_ptr(),
        h.data_ptr(), out.data_ptr(), None,
    )  # fmt: skip
    g, u = gu[0].chunk(2)
    assert torch.equal(torch.isnan(g), torch.isnan(gates)) and torch.equal(u, up)
    want, got = F.silu(g) * u, h[0]
    neg_inf = g == float("-inf")
    assert neg_inf.sum() == 1 and (got[neg_inf] == 0).all()
    nan = torch.isnan(want) & ~neg_inf
    assert torch.equal(torch.isnan(got) & ~neg_inf, nan)
    exact = (g >= -88) & ~nan
    assert torch.equal(got[exact].view(torch.int16), want[exact].view(torch.int16))
    rest = ~exact & ~nan & ~neg_inf
    assert rest.sum() > 15_000 and (got[rest].float() - want[rest].float()).abs().max() < 1e-36
    unrounded = (F.silu(g.float()) * u.float()).bfloat16()
    assert not torch.equal(unrounded[exact], want[exact])


# --------------------------------------------------------------------------- tile kernel


def rows_one_by_one(x, w, b):
    """The rows kernel's output, one x row per call."""
    return torch.cat([cpu.linear(x[i : i + 1], w, b) for i in range(x.shape[0])])


@needs_tiles
@pytest.mark.parametrize("k, n", [(1000, 301), (200, 131), (768, 3352), (64, 7)])
def test_tiles_give_the_rows_kernels_bits(k, n, matmul_mode, no_torch_matmul):
    """The tile kernel (fp32 FMAs on widened weights) gives the rows kernel's results (the bf16
    dot-product instruction) bit for bit, for every batch size of its range, a K tail, an N that
    is not a multiple of its tile, a bias and strided rows. Control: one changed weight row
    changes that output column only."""
    matmul_mode("fp32")
    wide, w, b = make(cpu.bf16_matmul.MIN_ROWS - 1, k + 40, n, seed=k + n, bias=True)
    x = wide[:, 17 : 17 + k]  # rows k + 40 apart
    w = w[:, :k].contiguous()
    want = rows_one_by_one(x, w, b)
    for m in (cpu.LINEAR_TILES_MIN_ROWS, 13, 17, 18, 40, x.shape[0]):
        assert cpu._use_tiles(m)
        assert torch.equal(cpu.linear(x[:m], w, b), want[:m]), m
    w2 = w.clone()
    w2[n // 2] = w2[n // 2].roll(1)
    changed = cpu.linear(x[:40], w2, b)
    assert (changed != want[:40]).nonzero()[:, 1].unique().tolist() == [n // 2]


@needs_tiles
@pytest.mark.parametrize("threads", [1, 3])
def test_tiles_do_not_depend_on_the_thread_count(threads, matmul_mode, no_torch_matmul):
    matmul_mode("fp32")
    x, w, b = make(30, 1000, 1003, seed=13, bias=True)  # 1,003 rows: a remainder per split
    want, got = on_two_and(threads, lambda: cpu.linear(x, w, b))
    assert torch.equal(got, want)


@needs_tiles
def test_tiles_flush_denormals_as_the_dot_product_instruction(matmul_mode, no_torch_matmul):
    """The bf16 dot-product instruction flushes denormal products and sums to zero; the tile
    kernel sets the same mode, so rows whose products are all denormal give 0 from both, where
    exact arithmetic gives 2^-140 per product (bf16 holds it: a real difference)."""
    matmul_mode("fp32")
    x, w, _ = make(16, 256, 40, seed=3)
    x[5] = 2.0**-70
    w[7] = 2.0**-70
    exact = (x[5].double() @ w[7].double()).item()
    assert exact > 0 and torch.tensor(exact).bfloat16().item() > 0
    rows = rows_one_by_one(x, w, None)
    tiles = cpu.linear(x, w, None)
    assert rows[5, 7].item() == 0.0 and torch.equal(tiles, rows)


def test_tiles_run_only_where_fp32_arithmetic_is_chosen(matmul_mode, monkeypatch):
    """Torch's bf16 matmul keeps the rows beyond the rows kernel where this CPU's bf16 matmul is
    chosen; the tile kernel's range is [LINEAR_TILES_MIN_ROWS, bf16_matmul.MIN_ROWS)."""
    matmul_mode("bf16")
    assert not cpu._use_tiles(40)
    x, w, b = make(40, 768, 64, seed=4, bias=True)
    assert torch.equal(cpu.linear(x, w, b), F.linear(x, w, b))
    matmul_mode("fp32")
    built = tiles_built()  # (without AVX512-BF16: never)
    assert [cpu._use_tiles(m) for m in (11, 12, 127, 128)] == [False, built, built, False]
    monkeypatch.setattr(cpu, "_tiles", [False])  # a build without the instructions
    assert not cpu._use_tiles(40)


# --------------------------------------------------------------------------- many rows


@pytest.mark.parametrize("k, n", SHAPES[:4])
@pytest.mark.parametrize("m", [128, 300])
def test_fp32_path_against_truth(k, n, m):
    x, w, b = make(m, k, n, seed=k + n + m, bias=m == 300)
    got = bf16_matmul.linear_fp32(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = err_in_ulps(got, x, w, b)
    assert err.max() <= 1.0 and err.mean() <= 0.3, (err.max(), err.mean())  # as the kernel's
    want = F.linear(x, w, b)  # torch's bf16 matmul: the same product, other sum order
    assert (got.float() - want.float()).abs().max() <= 2 * (want.float().abs().max() * 2**-8)
    if b is None and m == 128 and k == 768:
        bad = err_in_ulps(bf16_accumulated(x, w), x, w, b)
        assert bad.max() > 1.0 or bad.mean() > 0.3  # the bound catches bf16 accumulation


def test_fp32_path_in_blocks_is_the_whole_product(monkeypatch):
    x, w, b = make(130, 1000, 301, seed=11, bias=True)
    whole = bf16_matmul.linear_fp32(x.view(2, 65, 1000), w, b)
    assert whole.shape == (2, 65, 301)  # leading dims kept
    monkeypatch.setattr(
        bf16_matmul, "BLOCK_BYTES", 64 * 4 * 1000
    )  # blocks of 64 rows, a tail of 45
    blocked = bf16_matmul.linear_fp32(x, w, b)
    err = err_in_ulps(blocked, x, w, b)
    assert err.max() <= 1.0
    assert (blocked.float() - whole.view(130, 301).float()).abs().max() <= (
        whole.float().abs().max() * 2**-8
    )  # at most a rounding step apart where the sum order differs
    shifted = bf16_matmul.linear_fp32(x, w, torch.roll(b, 1))  # control: a bias off by a column
    assert err_in_ulps(shifted, x, w, b).max() > 1.0


def test_many_rows_take_the_chosen_path(matmul_mode, monkeypatch):
    calls = []
    real = bf16_matmul.linear_fp32
    monkeypatch.setattr(bf16_matmul, "linear_fp32", lambda *a: calls.append(1) or real(*a))
    x, w, b = make(bf16_matmul.MIN_ROWS, 768, 64, seed=4, bias=True)
    matmul_mode("fp32")
    assert err_in_ulps(cpu.linear(x, w, b), x, w, b).max() <= 1.0 and calls == [1]
    cpu.linear(x[:-1], w, b)  # one row short: torch's bf16 matmul, as the C kernel's limit
    assert calls == [1]
    matmul_mode("bf16")
    assert torch.equal(cpu.linear(x, w, b), F.linear(x, w, b)) and calls == [1]
    xf, wf = x.float(), w.float()
    matmul_mode("fp32")
    assert torch.equal(cpu.linear(xf, wf, None), F.linear(xf, wf)) and calls == [1]  # fp32 data


def test_choice_is_measured_once_or_taken_from_the_environment(matmul_mode, monkeypatch):
    from mambaradix.kernels import cpu_features

    measured = []
    monkeypatch.setattr(bf16_matmul, "_measure", lambda: measured.append(1) or "bf16")
    monkeypatch.setattr(cpu_features, "x86_without_bf16", lambda: True)  # AVX2: nothing measured
    matmul_mode("auto")
    assert bf16_matmul.choice() == "fp32" and measured == []
    monkeypatch.setattr(cpu_features, "x86_without_bf16", lambda: False)
    matmul_mode("auto")
    assert bf16_matmul.choice() == "bf16" and bf16_matmul.choice() == "bf16"
    assert measured == [1]
    for env in ("bf16", "FP32 "):
        monkeypatch.setenv("MAMBARADIX_BF16_MATMUL", env)
        matmul_mode("auto")
        assert bf16_matmul.choice() == env.strip().lower() and measured == [1]
    monkeypatch.setenv("MAMBARADIX_BF16_MATMUL", "fp16")
    matmul_mode("auto")
    with pytest.raises(ValueError, match="MAMBARADIX_BF16_MATMUL='fp16'"):
        bf16_matmul.choice()
    with pytest.raises(ValueError, match="expected one of auto, bf16, fp32"):
        matmul_mode("float32")


def test_measured_choice_needs_a_margin():
    assert bf16_matmul.decide(bf16_s=1.0, fp32_s=0.85) == "fp32"
    assert bf16_matmul.decide(bf16_s=1.0, fp32_s=0.95) == "bf16"  # within noise: keep bf16
    assert bf16_matmul.decide(bf16_s=0.5, fp32_s=1.0) == "bf16"


def test_wide_batches_take_the_rows_kernel_without_tiles(matmul_mode, monkeypatch):
    """Builds without the tile kernel whose rows kernel widens to fp32 (AVX2): batches of 17-127
    rows take the rows kernel where fp32 arithmetic is chosen, while their fp32 copy fits
    LINEAR_WIDE_X_BYTES, each row's bits those of the row alone; with bf16 chosen, torch's
    matmul. Elsewhere the tile kernel (AVX512-BF16) or torch's matmul takes them."""
    from mambaradix.kernels import native

    widens = bool(native.load("linear").linear_uses_f32x())
    matmul_mode("fp32")
    kinds = [cpu._decode_kernel(m, 1024) for m in (17, 64, 127, 128)]
    if tiles_built():
        assert kinds == ["tiles", "tiles", "tiles", None]
        return
    if not widens:
        assert kinds == [None] * 4
        return
    assert kinds == ["rows", "rows", "rows", None]
    assert cpu._decode_kernel(64, 8192) is None  # 2 MB of fp32 rows: the fp32 matmul
    x, w, b = make(40, 1000, 301, seed=21, bias=True)
    monkeypatch.setattr(cpu.F, "linear", lambda *a: pytest.fail("fell back to torch"))
    got = cpu.linear(x, w, b)
    assert torch.equal(got, rows_one_by_one(x, w, b))
    assert err_in_ulps(got, x, w, b).max() <= 1.0
    matmul_mode("bf16")
    assert cpu._decode_kernel(40, 1000) is None
