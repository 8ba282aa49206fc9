"""Sparse mixture of experts with an optional gated shared expert (Qwen3-Next / Qwen2-MoE).

Experts are stored fused, the transformers >= 5 layout: ``experts.gate_up_proj``
``[E, 2*I, H]`` and ``experts.down_proj`` ``[E, H, I]``. Checkpoints that store one tensor per
expert (``experts.{e}.gate_proj.weight`` ...) are stacked while loading
(``models.weights.stack_expert_weights``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaradix.kernels.backend import KernelBackend, reference_backend
from mambaradix.layers.mlp import GatedMLP, activation
from mambaradix.layers.ops import KernelUser, Linear


def route_topk(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: ``(weights [T, k], expert ids [T, k])``; weights renormalised to sum 1
    when ``normalize``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, top_k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype), idx


def expert_weights(num_experts: int, out_features: int, in_features: int) -> nn.Parameter:
    """A ``[E, out, in]`` stack of expert weights (the checkpoint's shape) laid out in memory as
    ``[E, in, out]``: ``w[e]`` is then the transposed view GEMMs read fastest (``x @ w[e].T``
    with ``w[e].T`` row-major; the per-expert loop got ~25% faster on CPU), and
    ``w.transpose(1, 2)`` is a contiguous operand for ``bmm``. Loading copies into it as into
    any parameter."""
    return nn.Parameter(torch.empty(num_experts, in_features, out_features).transpose(1, 2))


# at most this many (token, expert) pairs per expert on average: run all experts as one padded
# bmm instead of a loop of small GEMMs (decode batches; prefill keeps the exact-size loop)
PADDED_MAX_PER_EXPERT = 64


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act,
    ops: KernelBackend | None = None,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``, grouping tokens by expert.

    ``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``. Few tokens per expert (decode): one
    batched GEMM over all experts, each padded to the busiest one's count; otherwise one GEMM
    per expert with tokens. ``ops``: the backend (default the torch reference)."""
    T, K = ids.shape
    E = gate_up.shape[0]
    if T * K <= PADDED_MAX_PER_EXPERT * E:
        return _padded_experts(x, weights, ids, gate_up, down, act, ops or reference_backend())
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
        h = F.linear(xs[start : start + n], gate_up[e])
        g, u = h.chunk(2, dim=-1)
        out[start : start + n] = F.linear(act(g) * u, down[e])
        start += n
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    result = torch.zeros_like(x)
    result.index_add_(0, token_of, out)  # sum the k experts of each token
    return result


def _padded_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act,
    ops: KernelBackend,
) -> torch.Tensor:
    """``experts_forward`` as ``[E, cap, *]`` bmm's, ``cap`` the largest count: the pairs are
    laid out by ``moe_pad`` and summed back by ``moe_unpad`` (padding rows are never read)."""
    buf, pos = ops.moe_pad(x, ids, gate_up.shape[0])
    g, u = torch.bmm(buf, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(act(g) * u, down.transpose(1, 2))
    return ops.moe_unpad(y, ids, pos, weights)


class Experts(KernelUser, nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = expert_weights(num_experts, 2 * intermediate, hidden)
        self.down_proj = expert_weights(num_experts, hidden, intermediate)
        self.act = activation(act)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_forward(
            x, weights, ids, self.gate_up_proj, self.down_proj, self.act, self.ops
        )


class TopKRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_topk(F.linear(x, self.weight), self.top_k, self.normalize)


class SparseMoeBlock(nn.Module):
    """``experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (shared part
    optional). Parameter names follow HF: ``gate``, ``experts``, ``shared_expert``,
    ``shared_expert_gate``."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        shared_intermediate: int = 0,
        normalize: bool = True,
        act: str = "silu",
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(num_experts, hidden, top_k, normalize)
        self.experts = Experts(num_experts, hidden, intermediate, act)
        if shared_intermediate > 0:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
