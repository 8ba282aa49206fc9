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
from mambaradix.kernels.conv import conv_state_after
from mambaradix.kernels.registry import get_kernel
from mambaradix.layers.attention import BatchLayout


class ShortConv(nn.Module):
    """One LFM2 conv layer; ``state_index`` is its position among the recurrent layers."""

    def __init__(self, hidden_size: int, kernel: int, state_index: int, bias: bool = False) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.kernel = kernel
        self.state_index = state_index
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(
            hidden_size,
            hidden_size,
            kernel_size=kernel,
            groups=hidden_size,
            padding=kernel - 1,
            bias=bias,
        )
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    def state_layer_spec(self, conv_dtype: torch.dtype = torch.float32) -> StateLayerSpec:
        return StateLayerSpec(conv_shape=(self.hidden_size, self.kernel - 1), conv_dtype=conv_dtype)

    def forward(self, hidden: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """``hidden [T, hidden_size]`` packed as in ``layout.ctx`` -> ``[T, hidden_size]``."""
        ctx = layout.ctx
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        u = b * x
        pool = ctx.state_pool.conv[self.state_index]
        slots = ctx.state_slots
        weight = self.conv.weight.squeeze(1)
        states = pool.index_select(0, slots)
        if layout.all_decode:
            v, new = get_kernel("causal_conv1d_update")(u, states, weight, self.conv.bias, None)
            pool.index_copy_(0, slots, new.to(pool.dtype))
            snap_src = [k for k, r in enumerate(ctx.reqs) for _ in r.snapshots]
            if snap_src:
                dst = torch.tensor([s for r in ctx.reqs for _, s in r.snapshots], device=u.device)
                src = torch.tensor(snap_src, device=u.device)
                pool.index_copy_(0, dst, new.index_select(0, src).to(pool.dtype))
            return self.out_proj(c * v)

        lens = ctx.extend_lens
        v = get_kernel("causal_conv1d")(u, weight, self.conv.bias, states, lens, None)
        new_states, snap_states, snap_slots = [], [], []
        for k, (r, start, n_new) in enumerate(zip(ctx.reqs, ctx.starts, lens)):
            seg = u[start : start + n_new]
            new_states.append(conv_state_after(seg, states[k], n_new))
            for n, slot in r.snapshots:
                snap_states.append(conv_state_after(seg, states[k], n))
                snap_slots.append(slot)
        pool.index_copy_(0, slots, torch.stack(new_states).to(pool.dtype))
        if snap_slots:
            dst = torch.tensor(snap_slots, device=u.device)
            pool.index_copy_(0, dst, torch.stack(snap_states).to(pool.dtype))
        return self.out_proj(c * v)
