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
    """A ``[E, out, in]`` stack of expert weights, contiguous: the checkpoint's layout, each
    ``w[e]`` an ``nn.Linear`` weight, which the native decode kernels read row by row
    (``KernelBackend.moe_experts``). Loading copies into it as into any parameter. (It was laid
    out ``[E, in, out]`` before; on an Intel Xeon with AMX the expert GEMMs took the same time
    either way, bf16 and fp32, 16 to 1,024 rows an expert.)"""
    return nn.Parameter(torch.empty(num_experts, out_features, in_features))


def experts_forward(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    ops: KernelBackend | None = None,
    gated: bool = True,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``: the backend's ``moe_experts``
    (default the torch reference). ``gate_up`` ``[E, 2I, H]`` (``up`` ``[E, I, H]`` for plain
    experts, not ``gated``), ``down`` ``[E, H, I]``, ``act`` a Hugging Face ``hidden_act``
    name."""
    ops = ops or reference_backend()
    return ops.moe_experts(x, weights, ids, gate_up, down, act, gated)


class KeepsFloat32(nn.Module):
    """A module whose parameters named in ``fp32_params`` stay float32 whatever the model dtype
    (routing weights and biases: in bfloat16, near-tied expert scores would route otherwise)."""

    fp32_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001
        super()._apply(fn, recurse)
        for name in self.fp32_params:
            p = getattr(self, name, None)
            if p is not None:
                p.data = p.data.float()
        return self


class Experts(KernelUser, nn.Module):
    """The routed experts of a block, fused: gated (``gate_up_proj`` ``[E, 2I, H]``, Qwen /
    Granite) or plain (``up_proj`` ``[E, I, H]``, ``down(act(up(x)))``, Nemotron-H), and
    ``down_proj`` ``[E, H, I]``."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, act: str = "silu",
        gated: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.gated = gated
        up = expert_weights(num_experts, (2 if gated else 1) * intermediate, hidden)
        if gated:
            self.gate_up_proj = up
        else:
            self.up_proj = up
        self.down_proj = expert_weights(num_experts, hidden, intermediate)
        activation(act)  # an unsupported name fails here, at build
        self.act = act

    def expert_stacks(self) -> tuple[str, ...]:
        """The names of the expert weight stacks (``--quantization fp8`` stores them as fp8)."""
        return ("gate_up_proj" if self.gated else "up_proj", "down_proj")

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        up = self.gate_up_proj if self.gated else self.up_proj
        return experts_forward(x, weights, ids, up, self.down_proj, self.act, self.ops, self.gated)


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
            self.shared_expert_gate.quantizable = False
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
