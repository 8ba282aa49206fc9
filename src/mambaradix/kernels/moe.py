"""Mixture-of-experts routing around the expert GEMMs (torch reference kernels).

Decode batches run all experts as one padded batched GEMM: ``moe_pad`` lays the (token,
expert) pairs out as ``[E, cap, H]`` blocks, ``cap`` the busiest expert's count, and
``moe_unpad`` gathers the expert outputs back and sums each token's ``k`` of them by weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
