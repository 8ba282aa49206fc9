"""Dense gated MLP: ``down(act(gate(x)) * up(x))``; parameter names follow HF checkpoints."""

from __future__ import annotations

import torch
from torch import nn

from mambaradix.kernels.activation import activation
from mambaradix.layers.ops import KernelUser, Linear

__all__ = ["GATE_UP_MERGE", "GatedMLP", "activation"]


class GatedMLP(KernelUser, nn.Module):
    """``gate_up_proj`` is HF's ``gate_proj`` and ``up_proj`` stacked (one GEMM); checkpoints
    are mapped with ``loader.merge_weights(..., GATE_UP_MERGE)``. Without biases the block is
    one backend op (``gated_mlp``)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_name = act
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.bias is None and self.down_proj.bias is None:
            return self.ops.gated_mlp(
                x, self.gate_up_proj.weight, self.down_proj.weight, self.act_name
            )
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


GATE_UP_MERGE = {"gate_up_proj": ("gate_proj", "up_proj")}
