"""LFM2 gated short convolution over pooled conv state.

Per token: ``in_proj -> [B | C | x]``, ``u = B * x``, ``v = causal_depthwise_conv(u)`` (kernel
``L``, no activation, carrying the last L-1 values of ``u`` as conv state ``[hidden, L-1]``),
output ``out_proj(C * v)``. There is no temporal state (``temporal_shape`` None).
Parameter names follow Hugging Face's (``in_proj``, ``conv``, ``out_proj``).

State contract as in ``models/base.py``: start from ``state_pool.conv[j][slot]``, leave the
final state there, write the state after n new tokens into each snapshot slot ``(n, slot)``.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaradix.core import StateLayerSpec
from mambaradix.layers.ops import KernelUser, Linear
from mambaradix.layout import ForwardContext


class ShortConv(KernelUser, nn.Module):
    """One LFM2 conv layer; ``state_index`` is its position among the recurrent layers."""

    def __init__(self, hidden_size: int, kernel: int, state_index: int, bias: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.kernel = kernel
        self.state_index = state_index
        self.in_proj = Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(
            hidden_size,
            hidden_size,
            kernel_size=kernel,
            groups=hidden_size,
            padding=kernel - 1,
            bias=bias,
        )
        self.out_proj = Linear(hidden_size, hidden_size, bias=bias)

    def state_layer_spec(
        self, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype | None = None
    ) -> StateLayerSpec:
        """Conv state only (``ssm_dtype`` is accepted for a uniform mixer interface)."""
        return StateLayerSpec(conv_shape=(self.hidden_size, self.kernel - 1), conv_dtype=conv_dtype)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``hidden [T, hidden_size]`` packed as in ``ctx.layout`` -> ``[T, hidden_size]``:
        the backend's conv over the prefill segments and one step for the decodes."""
        layout, ops = ctx.layout, self.ops
        pool = ctx.state_pool.conv[self.state_index]
        weight, bias = self.conv.weight.squeeze(1), self.conv.bias
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        u = b * x
        v = torch.empty_like(u)
        for part, conv_op in (
            (layout.prefill, ops.conv1d_prefill),
            (layout.decode, ops.conv1d_decode),
        ):
            if part is not None:
                v = part.rows.put(v, conv_op(part.rows.take(u), weight, bias, pool, layout, None))
        return self.out_proj(c * v)
