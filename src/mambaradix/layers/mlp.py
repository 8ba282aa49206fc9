"""Dense gated MLP: ``down(act(gate(x)) * up(x))``; parameter names follow HF checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaradix.layers.ops import Linear

_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


def activation(name: str):
    """The activation function for a HF ``hidden_act`` name."""
    try:
        return _ACTS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTS)}") from None


class GatedMLP(nn.Module):
    """``gate_up_proj`` is HF's ``gate_proj`` and ``up_proj`` stacked (one GEMM); checkpoints
    are mapped with ``loader.merge_weights(..., GATE_UP_MERGE)``."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


GATE_UP_MERGE = {"gate_up_proj": ("gate_proj", "up_proj")}
