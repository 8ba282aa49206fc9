"""Mixture-of-experts routing around the expert GEMMs (torch reference kernels).

``moe_experts`` is the reference of the backend op: decode batches run all experts as one
padded batched GEMM (``moe_pad`` lays the (token, expert) pairs out as ``[E, cap, H]`` blocks,
``cap`` the busiest expert's count, and ``moe_unpad`` gathers the expert outputs back and sums
each token's ``k`` of them by weight); larger batches loop over the experts with tokens, one
exact-size GEMM pair each. An expert is a gated block (``act(gate) * up``, Qwen / Granite) or a
plain one (``act(up)``, Nemotron-H). The weighted sum runs in the routing weights' and the rows'
promoted dtype and is rounded once to the rows' (transformers' arithmetic for both: Qwen's
models pass weights in the rows' dtype, Nemotron-H's router keeps them in fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mambaradix.kernels.fp8 import Fp8Weight

if TYPE_CHECKING:
    from mambaradix.kernels.backend import KernelBackend

# at most this many (token, expert) pairs per expert on average: run all experts as one padded
# bmm instead of a loop of small GEMMs (decode batches; prefill keeps the exact-size loop)
PADDED_MAX_PER_EXPERT = 64


def moe_experts(
    ops: KernelBackend,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    padded_min_pairs: int = 0,
    gated: bool = True,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` (``gate_up`` ``[E, 2I, H]``, or
    ``up`` ``[E, I, H]`` when not ``gated``; ``down`` ``[E, H, I]``; ``act`` the activation):
    few pairs an expert, one padded batched GEMM over every expert (``ops``' ``moe_pad`` /
    ``moe_unpad``); else one GEMM pair per expert with tokens. ``padded_min_pairs``: batches of
    fewer (token, expert) pairs take the loop too (it reads only the routed experts' weights,
    the padded GEMM every expert's)."""
    T, K = ids.shape
    E = gate_up.shape[0]
    fp8_experts = isinstance(gate_up, Fp8Weight) or isinstance(down, Fp8Weight)
    # fp8 stacks (--quantization fp8): always the loop, each expert's rows through ``ops.linear``
    # (the CPU backend's runs decode rows from the codes; the padded GEMM would dequantize all)
    linear = ops.linear if fp8_experts else F.linear
    if not fp8_experts and padded_min_pairs <= T * K <= PADDED_MAX_PER_EXPERT * E:
        buf, pos = ops.moe_pad(x, ids, E)
        h = expert_activation(torch.bmm(buf, gate_up.transpose(1, 2)), act, gated)
        y = torch.bmm(h, down.transpose(1, 2))
        return ops.moe_unpad(y, ids, pos, weights).to(x.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    token_of = order // K
    xs = x.index_select(0, token_of)
    out = torch.empty(T * K, x.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        h = expert_activation(linear(xs[start : start + n], gate_up[e], None), act, gated)
        out[start : start + n] = linear(h, down[e], None)
        start += n
    weighted = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    result = torch.zeros(x.shape, dtype=weighted.dtype, device=x.device)
    result.index_add_(0, token_of, weighted)  # sum the k experts of each token
    return result.to(x.dtype)


def expert_activation(
    h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], gated: bool
) -> torch.Tensor:
    """A block's hidden rows from its first GEMM: ``act(gate) * up`` (gate columns first) or
    ``act(up)``."""
    if not gated:
        return act(h)
    g, u = h.chunk(2, dim=-1)
    return act(g) * u


def moe_pad(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, H]``, ``ids`` ``[T, K]`` -> ``(buf [E, cap, H], pos [T * K])``: pair ``p =
    t * K + k`` goes to row ``pos[p]`` of expert ``ids[t, k]``'s block, its rank among that
    expert's pairs in pair order. Rows past an expert's count are zeros."""
    T, K = ids.shape
    expert = ids.reshape(-1)
    onehot = F.one_hot(expert, num_experts)
    pos = (onehot.cumsum(0) * onehot).sum(1) - 1
    cap = int(onehot.sum(0).max())
    buf = x.new_zeros(num_experts, cap, x.shape[-1])
    buf[expert, pos] = x.repeat_interleave(K, dim=0)
    return buf, pos


def moe_unpad(
    y: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_k weights[t, k] * y[ids[t, k], pos[t * K + k]]`` for expert outputs ``y``
    ``[E, cap, H]`` laid out by ``moe_pad``; ``[T, H]``."""
    T, K = ids.shape
    picked = y[ids.reshape(-1), pos].view(T, K, -1)
    return (picked * weights.unsqueeze(-1)).sum(1)
