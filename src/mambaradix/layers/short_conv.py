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

    def state_layer_spec(
        self, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype | None = None
    ) -> StateLayerSpec:
        """Conv state only (``ssm_dtype`` is accepted for a uniform mixer interface)."""
        return StateLayerSpec(conv_shape=(self.hidden_size, self.kernel - 1), conv_dtype=conv_dtype)

    def forward(self, hidden: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """``hidden [T, hidden_size]`` packed as in ``layout.ctx`` -> ``[T, hidden_size]``.

        Decodes take the batched single-step update, prefills the packed varlen conv.
        """
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        u = b * x
        if layout.all_decode:
            v = self._step(layout, u)
        else:
            v = torch.empty_like(u)
            self._prefill(layout, u, v)
            if layout.decode_reqs:
                rows = layout.decode_rows
                v.index_copy_(0, rows, self._step(layout, u.index_select(0, rows)))
        return self.out_proj(c * v)

    def _step(self, layout: BatchLayout, u: torch.Tensor) -> torch.Tensor:
        ctx = layout.ctx
        pool = ctx.state_pool.conv[self.state_index]
        slots = layout.decode_slots
        v, new = get_kernel("causal_conv1d_update")(
            u, pool.index_select(0, slots), self.conv.weight.squeeze(1), self.conv.bias, None
        )
        pool.index_copy_(0, slots, new.to(pool.dtype))
        src = [k for k, i in enumerate(layout.decode_reqs) for _ in ctx.reqs[i].snapshots]
        if src:  # a snapshot after the only new token is the final state
            dst = [s for i in layout.decode_reqs for _, s in ctx.reqs[i].snapshots]
            idx = torch.tensor(src, device=u.device)
            pool.index_copy_(
                0, torch.tensor(dst, device=u.device), new.index_select(0, idx).to(pool.dtype)
            )
        return v

    def _prefill(self, layout: BatchLayout, u: torch.Tensor, v: torch.Tensor) -> None:
        ctx = layout.ctx
        pool = ctx.state_pool.conv[self.state_index]
        idx = layout.prefill_reqs
        lens = [ctx.extend_lens[i] for i in idx]
        if len(idx) == ctx.num_reqs:
            rows, slots, u_p = None, ctx.state_slots, u
        else:
            rows = torch.cat(
                [torch.arange(ctx.starts[i], ctx.starts[i] + ctx.extend_lens[i]) for i in idx]
            ).to(u.device)
            slots, u_p = ctx.state_slots[idx], u.index_select(0, rows)
        states = pool.index_select(0, slots)
        out = get_kernel("causal_conv1d")(
            u_p, self.conv.weight.squeeze(1), self.conv.bias, states, lens, None
        )
        if rows is None:
            v.copy_(out)
        else:
            v.index_copy_(0, rows, out)
        new_states, snap_states, snap_slots = [], [], []
        start = 0
        for k, (i, n_new) in enumerate(zip(idx, lens)):
            seg = u_p[start : start + n_new]
            new_states.append(conv_state_after(seg, states[k], n_new))
            for n, slot in ctx.reqs[i].snapshots:
                snap_states.append(conv_state_after(seg, states[k], n))
                snap_slots.append(slot)
            start += n_new
        pool.index_copy_(0, slots, torch.stack(new_states).to(pool.dtype))
        if snap_slots:
            dst = torch.tensor(snap_slots, device=u.device)
            pool.index_copy_(0, dst, torch.stack(snap_states).to(pool.dtype))
