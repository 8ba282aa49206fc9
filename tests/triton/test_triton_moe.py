"""The Triton mixture-of-experts kernels (``kernels/triton/moe.py``) against the torch reference
(``kernels/moe.py``), the ``cuda`` backend's ``moe_experts`` op: decode-sized batches (fewer
pairs than experts, and more), a prefill-sized one, fp32 and bf16, gated silu experts and plain
relu² ones (Nemotron-H's), skewed routing (one expert taking most pairs, several blocks of it),
and the alignment on its own.

Negative controls: an unrouted expert's NaN weights change nothing while a routed one's reach
the output (only the routed experts are read, and each pair reads its own); a block told the
wrong expert fails the comparison. The alignment runs on ``meta`` tensors, which hold no values:
any host read of a device value (``int()``, ``.item()``, a boolean mask, ``bincount``'s size)
fails there, so that test fails if a sync creeps in; the reference's ``moe_pad`` is the control.

Under the interpreter bf16 ``tl.dot`` operands are widened to fp32 (``interpreter.py``), as a
GPU's bf16 tensor cores multiply them exactly; fp32 runs ``ieee`` here as on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from mambaradix.kernels import moe as reference
from mambaradix.kernels.activation import activation
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.kernels.triton import moe as triton_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SILU = activation("silu")
BLOCKS = [(True, "silu"), (False, "relu2")]  # (gated, activation): Qwen / Granite, Nemotron-H


def _experts(E, H, inter, dtype, seed=0, gated=True):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if gated else inter
    gate_up = (torch.randn(E, rows, H, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(dtype)
    return gate_up.to(DEVICE), down.to(DEVICE)


def _routing(T, E, K, seed=1, skew=False):
    """Routing weights (fp32, summing to 1) and distinct expert ids, as a router gives them."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if skew:
        scores[:, 0] += 1.0  # expert 0 in every token's top k: several blocks of one expert
    w, ids = scores.softmax(-1).topk(K, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def _x(T, H, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(dtype).to(DEVICE)


def _reference(x, w, ids, gate_up, down, act=SILU, gated=True):
    return reference.moe_experts(TorchBackend(), x, w, ids, gate_up, down, act, 0, gated)


CASES = [  # (tokens, experts, top k, hidden, intermediate, skewed routing)
    (1, 16, 2, 48, 40, False),  # fewer pairs than experts: a decode step
    (5, 8, 3, 64, 32, False),  # more pairs than experts, still decode-sized blocks
    (40, 8, 2, 64, 72, True),  # one expert in every token: its run spans several blocks
    (150, 6, 2, 40, 24, False),  # prefill-sized: 64-pair blocks
]


@pytest.mark.parametrize("gated,act", BLOCKS, ids=["gated", "plain"])
@pytest.mark.parametrize("T,E,K,H,inter,skew", CASES)
def test_fp32_equals_the_reference(T, E, K, H, inter, skew, gated, act):
    gate_up, down = _experts(E, H, inter, torch.float32, gated=gated)
    w, ids = _routing(T, E, K, skew=skew)
    x = _x(T, H, torch.float32)
    fn = activation(act)
    got = triton_moe.moe_experts(x, w, ids, gate_up, down, fn, gated)
    want = _reference(x, w, ids, gate_up, down, fn, gated)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gated,act", BLOCKS, ids=["gated", "plain"])
@pytest.mark.parametrize("T,E,K,H,inter,skew", CASES)
def test_bf16_is_the_fp32_computation_rounded(T, E, K, H, inter, skew, gated, act):
    """bf16: within bf16 roundings of the same computation in fp32 on the same bf16 inputs (each
    GEMM rounds its output once, as the reference's), and close to the reference itself."""
    gate_up, down = _experts(E, H, inter, torch.bfloat16, gated=gated)
    w, ids = _routing(T, E, K, skew=skew)
    x = _x(T, H, torch.bfloat16)
    fn = activation(act)
    got = triton_moe.moe_experts(x, w, ids, gate_up, down, fn, gated)
    assert got.dtype is torch.bfloat16
    exact = _reference(x.float(), w, ids, gate_up.float(), down.float(), fn, gated)
    scale = exact.abs().max()
    assert (got.float() - exact).abs().max() <= 2e-2 * scale
    ref = _reference(x, w, ids, gate_up, down, fn, gated)
    assert (got.float() - ref.float()).abs().max() <= 2e-2 * scale


def test_only_routed_experts_are_read():
    """NaN weights in an expert no token routes to change nothing; in a routed one they reach
    exactly the tokens routed there (the negative control)."""
    T, E, K, H, inter = 4, 16, 2, 48, 40
    gate_up, down = _experts(E, H, inter, torch.float32)
    w, ids = _routing(T, E, K)
    x = _x(T, H, torch.float32)
    clean = triton_moe.moe_experts(x, w, ids, gate_up, down, SILU)
    unrouted = sorted(set(range(E)) - set(ids.reshape(-1).tolist()))
    gate_up[unrouted[0]] = float("nan")
    down[unrouted[-1]] = float("nan")
    assert torch.equal(triton_moe.moe_experts(x, w, ids, gate_up, down, SILU), clean)
    routed = int(ids[2, 0])
    down[routed] = float("nan")
    got = triton_moe.moe_experts(x, w, ids, gate_up, down, SILU)
    hit = (ids == routed).any(-1)
    assert got[hit].isnan().all() and not got[~hit].isnan().any()


def test_a_block_given_the_wrong_expert_is_caught(monkeypatch):
    """Negative control of the comparison: blocks told the next expert along give outputs the
    reference check rejects."""
    T, E, K, H, inter = 5, 8, 3, 64, 32
    gate_up, down = _experts(E, H, inter, torch.float32)
    w, ids = _routing(T, E, K)
    x = _x(T, H, torch.float32)
    align = triton_moe.align

    def shifted(ids, num_experts, block_m):
        pairs, block_expert = align(ids, num_experts, block_m)
        live = block_expert < num_experts
        return pairs, torch.where(live, (block_expert + 1) % num_experts, block_expert)

    monkeypatch.setattr(triton_moe, "align", shifted)
    got = triton_moe.moe_experts(x, w, ids, gate_up, down, SILU)
    assert not torch.allclose(got, _reference(x, w, ids, gate_up, down), atol=1e-3)


@pytest.mark.parametrize("skew", [False, True])
def test_alignment_puts_every_pair_once_in_its_experts_blocks(skew):
    T, E, K, BM = 37, 8, 3, 16
    _, ids = _routing(T, E, K, skew=skew)
    pairs, block_expert = triton_moe.align(ids, E, BM)
    P = T * K
    assert pairs.numel() == block_expert.numel() * BM
    assert block_expert.numel() == -(-P // BM) + min(E, P)
    flat = ids.reshape(-1).tolist()
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        rows = [p for p in pairs[b * BM : (b + 1) * BM].tolist() if p < P]
        if e >= E:
            assert rows == []
            continue
        assert all(flat[p] == e for p in rows) and rows == sorted(rows)
        seen += rows
    assert sorted(seen) == list(range(P))
    live = block_expert[block_expert < E].tolist()
    assert live == sorted(live) and (block_expert[len(live) :] == E).all()


def test_alignment_reads_no_device_value():
    """On ``meta`` tensors (shapes, no values) every step that would read a value back to the
    host fails: the alignment runs there, and the reference's padding (``int(cap)``) does not
    (the control)."""
    ids = torch.empty(4, 2, dtype=torch.int64, device="meta")
    pairs, block_expert = triton_moe.align(ids, 64, 16)
    assert pairs.shape == (16 * (1 + 8),) and block_expert.shape == (9,)
    x = torch.empty(4, 32, device="meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        reference.moe_pad(x, ids, 64)
