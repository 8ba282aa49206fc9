"""Mamba2 mixer over pooled recurrent state (GraniteMoeHybrid, NemotronH, Bamba-style layers).

Per token: ``in_proj -> [gate z | xBC | dt]``; ``xBC`` goes through a causal depthwise conv
(+SiLU) carrying the last K-1 inputs as conv state; the SSM scan (``kernels/mamba2.py``) carries
``[heads, head_dim, d_state]``; the output is ``RMSNorm(y * silu(z))`` per group, then
``out_proj``. Parameter names follow Hugging Face's (``in_proj``, ``conv1d``, ``dt_bias``,
``A_log``, ``D``, ``norm.weight``, ``out_proj``) so checkpoints load by name.

State contract (see ``models/base.py``): request i starts from
``state_pool.conv[j][slot_i]`` / ``temporal[j][slot_i]``, leaves its final state there and
writes the state after n new tokens into every snapshot slot ``(n, slot)``.
Requests with one new token take the batched single-step path; longer ones the chunked scan.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mambaradix.core import ForwardContext, StateLayerSpec
from mambaradix.kernels.conv import conv_state_after
from mambaradix.kernels.mamba2 import ChunkPlan, process_dt
from mambaradix.kernels.registry import get_kernel
from mambaradix.layers.attention import BatchLayout
from mambaradix.layers.norm import GatedRMSNorm

logger = logging.getLogger(__name__)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer; ``state_index`` is its position among the model's recurrent layers."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        d_state: int,
        conv_kernel: int,
        state_index: int,
        *,
        conv_bias: bool = True,
        proj_bias: bool = False,
        norm_eps: float = 1e-6,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        activation: str = "silu",
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba heads {num_heads} not divisible by n_groups {n_groups}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.d_state = n_groups, d_state
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * d_state
        self.conv_kernel = conv_kernel
        self.state_index = state_index
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.activation = activation
        self.chunk_size = chunk_size
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate + self.conv_dim + num_heads, bias=proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=conv_kernel,
            groups=self.conv_dim,
            padding=conv_kernel - 1,
            bias=conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(
            self.intermediate,
            norm_eps,
            norm_before_gate=False,
            group_size=self.intermediate // n_groups,
        )
        self.out_proj = nn.Linear(self.intermediate, hidden_size, bias=proj_bias)

    def state_layer_spec(
        self, conv_dtype: torch.dtype = torch.float32, ssm_dtype: torch.dtype = torch.float32
    ) -> StateLayerSpec:
        return StateLayerSpec(
            conv_shape=(self.conv_dim, self.conv_kernel - 1),
            temporal_shape=(self.num_heads, self.head_dim, self.d_state),
            conv_dtype=conv_dtype,
            temporal_dtype=ssm_dtype,
        )

    # ------------------------------------------------------------------ forward

    def forward(self, hidden: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """``hidden [T, hidden_size]`` packed as in ``layout.ctx`` -> ``[T, hidden_size]``."""
        proj = self.in_proj(hidden)
        gate, xbc, dt_raw = proj.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        H, P = self.num_heads, self.head_dim
        y = torch.empty((hidden.shape[0], H, P), dtype=torch.float32, device=hidden.device)
        if layout.prefill_reqs:
            self._forward_chunked(layout, xbc, dt_raw, y)
        if layout.decode_reqs:
            self._forward_step(layout, xbc, dt_raw, y)
        out = self.norm(y.view(-1, self.intermediate).to(hidden.dtype), gate)
        return self.out_proj(out)

    def _pools(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.state_index
        return ctx.state_pool.conv[j], ctx.state_pool.temporal[j]

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv1d.weight.squeeze(1), -torch.exp(self.A_log.float())

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.d_state
        x, b, c = xbc.split([self.intermediate, gn, gn], dim=-1)
        t = xbc.shape[0]
        return (
            x.reshape(t, self.num_heads, self.head_dim),
            b.reshape(t, self.n_groups, self.d_state),
            c.reshape(t, self.n_groups, self.d_state),
        )

    def _forward_step(
        self,
        layout: BatchLayout,
        xbc: torch.Tensor,
        dt_raw: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        """Batched single-token update of every decode request of the layout."""
        ctx, idx, slots = layout.ctx, layout.decode_reqs, layout.decode_slots
        conv_pool, ssm_pool = self._pools(ctx)
        if layout.all_decode:
            rows = None
            xbc_s, dt_s = xbc, dt_raw
        else:
            rows = layout.decode_rows
            xbc_s, dt_s = xbc.index_select(0, rows), dt_raw.index_select(0, rows)
        weight, A = self._weights()
        conv_out, new_conv = get_kernel("causal_conv1d_update")(
            xbc_s, conv_pool.index_select(0, slots), weight, self.conv1d.bias, self.activation
        )
        x, b, c = self._split_xbc(conv_out)
        dt = process_dt(dt_s, self.dt_bias, self.dt_limit)
        ys, new_ssm = get_kernel("mamba2_step")(
            ssm_pool.index_select(0, slots), x, dt, A, b, c, self.D
        )
        if rows is None:
            y.copy_(ys)
        else:
            y.index_copy_(0, rows, ys)
        conv_pool.index_copy_(0, slots, new_conv.to(conv_pool.dtype))
        ssm_pool.index_copy_(0, slots, new_ssm.to(ssm_pool.dtype))
        # a snapshot after the only new token is the final state
        snap_src, snap_dst = [], []
        for k, i in enumerate(idx):
            for _, slot in ctx.reqs[i].snapshots:
                snap_src.append(k)
                snap_dst.append(slot)
        if snap_dst:
            src = torch.tensor(snap_src, device=xbc.device)
            dst = torch.tensor(snap_dst, device=xbc.device)
            conv_pool.index_copy_(0, dst, new_conv.index_select(0, src).to(conv_pool.dtype))
            ssm_pool.index_copy_(0, dst, new_ssm.index_select(0, src).to(ssm_pool.dtype))

    def _forward_chunked(
        self,
        layout: BatchLayout,
        xbc: torch.Tensor,
        dt_raw: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        """Chunked scan of every prefill request of the layout, with its snapshots."""
        ctx, idx = layout.ctx, layout.prefill_reqs
        conv_pool, ssm_pool = self._pools(ctx)
        reqs = [ctx.reqs[i] for i in idx]
        lens = [ctx.extend_lens[i] for i in idx]
        contiguous = len(idx) == len(ctx.reqs)
        if contiguous:
            rows, slots = None, ctx.state_slots
            xbc_m, dt_m = xbc, dt_raw
        else:
            rows = torch.cat(
                [torch.arange(ctx.starts[i], ctx.starts[i] + ctx.extend_lens[i]) for i in idx]
            ).to(xbc.device)
            slots = ctx.state_slots[idx]
            xbc_m, dt_m = xbc.index_select(0, rows), dt_raw.index_select(0, rows)

        weight, A = self._weights()
        conv_in = conv_pool.index_select(0, slots)
        conv_out = get_kernel("causal_conv1d")(
            xbc_m, weight, self.conv1d.bias, conv_in, lens, self.activation
        )
        x, b, c = self._split_xbc(conv_out)
        dt = process_dt(dt_m, self.dt_bias, self.dt_limit)
        plan = ChunkPlan.build(
            lens, [[n for n, _ in r.snapshots] for r in reqs], self.chunk_size, xbc.device
        )
        ys, final, snaps = get_kernel("mamba2_chunk_scan")(
            x, dt, A, b, c, self.D, ssm_pool.index_select(0, slots), plan
        )
        if rows is None:
            y.copy_(ys)
        else:
            y.index_copy_(0, rows, ys)

        # conv states: the last K-1 conv inputs before each wanted position
        new_conv, snap_conv, snap_slots = [], [], []
        start = 0
        for k, (r, n_new) in enumerate(zip(reqs, lens)):
            seg = xbc_m[start : start + n_new]
            new_conv.append(conv_state_after(seg, conv_in[k], n_new))
            for n, slot in r.snapshots:
                snap_conv.append(conv_state_after(seg, conv_in[k], n))
                snap_slots.append(slot)
            start += n_new
        conv_pool.index_copy_(0, slots, torch.stack(new_conv).to(conv_pool.dtype))
        ssm_pool.index_copy_(0, slots, final.to(ssm_pool.dtype))
        if snap_slots:
            dst = torch.tensor(snap_slots, device=xbc.device)
            conv_pool.index_copy_(0, dst, torch.stack(snap_conv).to(conv_pool.dtype))
            ssm_pool.index_copy_(0, dst, snaps.to(ssm_pool.dtype))
