"""Activation functions by their Hugging Face ``hidden_act`` names (torch reference)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function for a HF ``hidden_act`` name."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported activation {name!r}; supported: {sorted(ACTIVATIONS)}"
        ) from None
