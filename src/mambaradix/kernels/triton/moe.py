"""A mixture of experts' routed part as Triton kernels: each (token, expert) pair's row goes
through its own expert's weights only, with no host-device sync (a decode step holding it can
be captured in a CUDA graph).

The semantics are the backend op's (``KernelBackend.moe_experts``; the reference is
``kernels/moe.py``): ``out[t] = sum_k weights[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t]))``,
``e = ids[t, k]``, expert stacks ``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]`` as the
checkpoint stores them (plain experts, Nemotron-H's: ``down_e(act(up_e(x[t])))``, ``up``
``[E, I, H]``). Where the reference runs all experts as one padded batched GEMM (every
expert's weights read, and the padding's size read back to the host) or loops over experts on
the host, this is a grouped GEMM over blocks of one expert's pairs::

    align           (torch, on the device) pair p = t * K + k sorted by expert, each expert's
                    run padded to whole blocks of BLOCK_M; ``pairs`` [B * BLOCK_M] (pad: P)
                    and ``block_expert`` [B] (past the last block: E)
    _moe_gemm       grid (B, N blocks): block b's rows times expert block_expert[b]'s weight
                    rows, fp32 accumulation, rounded once into the pair's output row
    (torch)         act(gate) * up (or act(up)) on the pairs' rows, as the reference does
    _moe_gemm       the same with ``down``
    (torch)         each token's k rows summed by weight in fp32, rounded once

``B`` is the bound ``cdiv(P, BLOCK_M) + min(E, P)`` (a block more than the pairs need per expert
with pairs at most), so every shape comes from the inputs' shapes: blocks past the experts' runs
exit at once. A batch-1 decode step of Qwen3-Next's 512 experts, top 10, reads the 10 routed
experts' weights (the padded GEMM read all 512).

Rounding: each GEMM's output is rounded to the activations' dtype as the reference's
``F.linear`` rounds it, and the activation product is the reference's own torch code, so the
two differ only in summation order inside a GEMM and in the final weighted sum (fp32 here,
rounded once; the reference sums in the weights' and rows' promoted dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mambaradix.kernels.moe import expert_activation

DECODE_BLOCK_M = 16  # pairs per block for decode-sized batches (tl.dot's smallest M)
PREFILL_BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_experts, N, K,
    sa_r, sw_e, sw_n, so_r,
    ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    if e >= num_experts:  # past the experts' runs: nothing to do
        return
    p = tl.load(pairs_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    live = p < num_pairs
    row = (p // ROW_DIV).to(tl.int64)  # the input row: the token's (ROW_DIV = k), or the pair's
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    w_rows = w_ptr + e.to(tl.int64) * sw_e + n[None, :].to(tl.int64) * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(a_ptr + row[:, None] * sa_r + k[None, :], mask=live[:, None] & k_mask[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_rows + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out = out_ptr + p.to(tl.int64)[:, None] * so_r + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & n_mask[None, :])


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` ``[T, K]`` -> ``(pairs, block_expert)``: the pairs ``t * K + k`` sorted by expert
    (stable), each expert's run padded with ``P`` to whole blocks of ``block_m``; the expert of
    each block, ``num_experts`` past the last run. Device ops only: no value is read back."""
    P = ids.numel()
    dev = ids.device
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(P, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (block_end - blocks)[sorted_e] * block_m + rank
    num_blocks = triton.cdiv(P, block_m) + min(num_experts, P)
    pairs = torch.full((num_blocks * block_m,), P, dtype=torch.int32, device=dev)
    pairs[dest] = order.to(torch.int32)
    steps = torch.arange(num_blocks, device=dev)
    block_expert = torch.searchsorted(block_end, steps, right=True).to(torch.int32)
    return pairs, block_expert


def _gemm(a, w, pairs, block_expert, num_pairs, row_div, block_m) -> torch.Tensor:
    """``out[p] = a[p // row_div] @ w[e(p)]^T`` for every pair ``p`` (``w`` ``[E, N, K]``)."""
    E, N, K = w.shape
    out = a.new_empty(num_pairs, N)
    grid = (block_expert.numel(), triton.cdiv(N, BLOCK_N))
    _moe_gemm_kernel[grid](
        a, w, out, pairs, block_expert, num_pairs, E, N, K,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROW_DIV=row_div, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    gated: bool = True,
) -> torch.Tensor:
    """The backend op (module docstring): ``x`` ``[T, H]``, ``ids`` / ``weights`` ``[T, K]``."""
    T, K = ids.shape
    E = gate_up.shape[0]
    P = T * K
    if P == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    block_m = DECODE_BLOCK_M if P <= 4 * E else PREFILL_BLOCK_M
    pairs, block_expert = align(ids, E, block_m)
    first = _gemm(x, gate_up, pairs, block_expert, P, K, block_m)
    h = expert_activation(first, act, gated).contiguous()
    y = _gemm(h, down, pairs, block_expert, P, 1, block_m).view(T, K, -1)
    w = weights.to(torch.promote_types(weights.dtype, x.dtype)).float()  # as the reference's
    return (y.float() * w.unsqueeze(-1)).sum(1).to(x.dtype)
