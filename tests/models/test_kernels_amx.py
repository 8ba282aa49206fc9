"""The AMX linear (``csrc/linear.c``'s tile-unit kernel, every decode batch of bf16 rows below
``bf16_matmul.MIN_ROWS`` on a CPU whose tiles Linux grants): against float64 truth with the
bound the dot-product kernels meet (fp32 sums, one rounding; a bf16-accumulating kernel fails
it), a row's output bit for bit the same alone, in any batch (blocks of 16 x rows, a partial
last block, passes of three blocks) and on any thread count, tails of K (not a multiple of 32,
odd) and of N (not a multiple of 16), a bias, strided rows; the gated MLP as its composition;
on wherever granted unless ``$MAMBARADIX_AMX=0``, and ``set_amx(False)`` gives the
dot-product kernels back. Skipped, with
the reason, on CPUs without AMX: there the dot-product kernels run (their own tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_kernels_linear import bf16_accumulated, err_in_ulps, make, on_two_and

from mambaradix.kernels import bf16_matmul, cpu
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend


def amx_granted() -> bool:
    if shutil.which("cc") is None:
        return False
    was = cpu.uses_amx()
    on = cpu.set_amx(True)
    cpu.set_amx(was)
    return on


pytestmark = pytest.mark.skipif(
    not amx_granted(),
    reason="no AMX here (a CPU or build without AMX-BF16, or Linux refused the tile state)",
)


@pytest.fixture(autouse=True)
def amx(monkeypatch):
    """AMX on for each test, torch's matmul refused (every batch here takes the C kernel)."""
    was = cpu.uses_amx()
    assert cpu.set_amx(True)
    monkeypatch.setattr(cpu.F, "linear", lambda *a: pytest.fail("fell back to torch"))
    try:
        yield
    finally:
        cpu.set_amx(was)


@pytest.mark.parametrize("k, n", [(1024, 2048), (3584, 1024), (1000, 301), (33, 16), (203, 67)])
@pytest.mark.parametrize("m", [1, 3, 4, 16, 17, 40, 127])
def test_amx_linear_against_truth(k, n, m):
    x, w, b = make(m, k, n, seed=k + n + m, bias=m in (3, 17))
    got = cpu.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = err_in_ulps(got, x, w, b)
    assert err.max() <= 1.0 and err.mean() <= 0.3, (err.max(), err.mean())
    if b is None and m == 1 and k >= 768:
        bad = err_in_ulps(bf16_accumulated(x, w), x, w, b)
        assert bad.max() > 1.0 or bad.mean() > 0.3  # the bound catches bf16 accumulation


@pytest.mark.parametrize("m", [4, 16, 40, 127])
def test_amx_row_does_not_depend_on_its_batch(m):
    """Each row alone, and slices that regroup the blocks of 16, give the batch's bits (K with
    a tail of 8, 301 weight rows: a partial last group). Control: a weight row changed in its
    last element (the K tail's chunk) changes that column only."""
    x, w, b = make(m, 1000, 301, seed=m, bias=True)
    whole = cpu.linear(x, w, b)
    for i in range(m):
        assert torch.equal(cpu.linear(x[i : i + 1], w, b)[0], whole[i])
    for lo, hi in [(1, m), (m // 2, m), (0, (m + 1) // 2)]:
        assert torch.equal(cpu.linear(x[lo:hi], w, b), whole[lo:hi])
    w2 = w.clone()
    w2[300, -1] = -w2[300, -1] * 4 + 1
    changed = cpu.linear(x, w2, b) != whole
    assert changed[:, 300].any() and not changed[:, :300].any()


@pytest.mark.parametrize("threads", [1, 3])
def test_amx_row_does_not_depend_on_the_thread_count(threads):
    x, w, b = make(20, 1000, 301, seed=11, bias=True)
    want, got = on_two_and(threads, lambda: cpu.linear(x, w, b))
    assert torch.equal(got, want)


def test_amx_strided_rows():
    wide = make(20, 1000, 1, seed=2)[0]
    x = wide[:, 100:868]
    _, w, _ = make(1, 768, 96, seed=3)
    assert x.stride(0) == 1000
    assert torch.equal(cpu.linear(x, w, None), cpu.linear(x.contiguous(), w, None))


@pytest.mark.parametrize("m", [1, 4, 33])
def test_amx_gated_mlp_is_the_composition_bit_for_bit(m):
    """Qwen3.5-0.8B's MLP widths. Control: another down projection gives other outputs."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1024, generator=g).bfloat16()
    gate_up = (torch.randn(2 * 3584, 1024, generator=g) * 0.05).bfloat16()
    down = (torch.randn(1024, 3584, generator=g) * 0.05).bfloat16()
    fused = cpu.gated_mlp(x, gate_up, down, "silu")
    assert fused is not None
    assert torch.equal(fused, TorchBackend.gated_mlp(CpuBackend(), x, gate_up, down, "silu"))
    assert not torch.equal(cpu.gated_mlp(x, gate_up, down.roll(1, dims=0), "silu"), fused)


def test_amx_takes_every_batch_below_the_matmul_rows():
    """1 to MIN_ROWS - 1 rows take the C kernel (torch's matmul refused); MIN_ROWS rows do not."""
    for m in (1, 16, 17, 64, bf16_matmul.MIN_ROWS - 1):
        assert cpu._decode_kernel(m, 4096) == "rows"
    assert cpu._decode_kernel(bf16_matmul.MIN_ROWS, 4096) is None


def test_amx_off_gives_the_dot_product_kernels():
    """``set_amx(False)``: the dot-product kernels run (the same product within a rounding step,
    in another sum order); a fresh process has AMX on unless ``$MAMBARADIX_AMX=0``."""
    x, w, b = make(8, 1000, 301, seed=4, bias=True)
    on = cpu.linear(x, w, b)
    assert not cpu.set_amx(False)
    off = cpu.linear(x, w, b)
    assert (on.float() - off.float()).abs().max() <= on.float().abs().max() * 2**-7
    code = "from mambaradix.kernels import cpu; print(cpu.uses_amx())"
    base = {k: v for k, v in os.environ.items() if k != "MAMBARADIX_AMX"}
    for env, want in (
        ({}, "True"),
        ({"MAMBARADIX_AMX": "0"}, "False"),
        ({"MAMBARADIX_AMX": "1"}, "True"),
    ):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**base, **env}, check=True)  # fmt: skip
        assert out.stdout.strip() == want, out
