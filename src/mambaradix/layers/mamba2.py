"""Mamba2 mixer over pooled recurrent state (GraniteMoeHybrid, NemotronH, Bamba-style layers).

Per token: ``in_proj -> [gate z | xBC | dt]``; ``xBC`` goes through a causal depthwise conv
(+SiLU) carrying the last K-1 inputs as conv state; the SSM scan (``kernels/mamba2.py``) carries
``[heads, head_dim, d_state]``; the output is ``RMSNorm(y * silu(z))`` per group, then
``out_proj``. Parameter names follow Hugging Face's (``in_proj``, ``conv1d``, ``dt_bias``,
``A_log``, ``D``, ``norm.weight``, ``out_proj``) so checkpoints load by name. Falcon-H1's
variants: no norm (``y * silu(z)``), or the norm before the gate.

State contract (see ``models/base.py``): request i starts from
``state_pool.conv[j][slot_i]`` / ``temporal[j][slot_i]``, leaves its final state there and
writes the state after n new tokens into every snapshot slot ``(n, slot)``. The backend
(``self.ops``) runs the conv and the scan: prefill segments the chunked scan, decodes one fused
step (conv, dt, scan: ``mamba2_mixer_decode``).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from mambaradix.core import StateLayerSpec
from mambaradix.kernels.mamba2 import process_dt, split_xbc
from mambaradix.kernels.norm import GatedNorm, silu_gate
from mambaradix.layers.norm import GatedRMSNorm
from mambaradix.layers.ops import KernelUser, Linear
from mambaradix.layout import ForwardContext

logger = logging.getLogger(__name__)


class Mamba2Mixer(KernelUser, nn.Module):
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
        out_bias: bool | None = None,
        gated_norm: bool = True,
        norm_before_gate: bool = False,
        projections: bool = True,
    ) -> None:
        """``projections`` False: no ``in_proj`` / ``out_proj`` of its own (a model that fuses
        them with other layers' calls ``mix`` on its projection)."""
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"mamba heads {num_heads} not divisible by n_groups {n_groups}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.d_state = n_groups, d_state
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * d_state
        self.scan_shape = (num_heads, head_dim, n_groups, d_state)  # (H, P, G, N)
        self.conv_kernel = conv_kernel
        self.state_index = state_index
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.activation = activation
        self.in_width = self.intermediate + self.conv_dim + num_heads  # [z | xBC | dt]
        self.in_proj = Linear(hidden_size, self.in_width, bias=proj_bias) if projections else None
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=conv_kernel,
            groups=self.conv_dim,
            padding=conv_kernel - 1,
            bias=conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        # log(1..H) as Python numbers: built on the meta device (the loader's), torch.arange
        # dispatches through torch's decompositions, whose first use imports torch._dynamo (~1.5 s
        # of every start)
        self.A_log = nn.Parameter(torch.tensor([math.log(h) for h in range(1, num_heads + 1)]))
        self.D = nn.Parameter(torch.ones(num_heads))
        # the output: RMSNorm(y * silu(z)) per group (Mamba2), the norm first then the gate
        # (norm_before_gate), or no norm, y * silu(z) (gated_norm False: Falcon-H1's default)
        self.norm = (
            GatedRMSNorm(
                self.intermediate,
                norm_eps,
                norm_before_gate=norm_before_gate,
                group_size=self.intermediate // n_groups,
            )
            if gated_norm
            else None
        )
        # whether a decode op can finish the output stage (all but the norm-first variant)
        self.decode_output = not (gated_norm and norm_before_gate)
        out_bias = proj_bias if out_bias is None else out_bias
        self.out_proj = (
            Linear(self.intermediate, hidden_size, bias=out_bias) if projections else None
        )

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

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``hidden [T, hidden_size]`` packed as in ``ctx.layout`` -> ``[T, hidden_size]``."""
        return self.out_proj(self.mix(self.in_proj(hidden), ctx))

    def mix(self, proj: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The mixer on its input projection ``proj`` ``[T, in_width]`` (``[z | xBC | dt]``;
        rows may be strided, as columns of a wider projection) -> its gated output
        ``[T, intermediate]``, before ``out_proj``."""
        layout, ops = ctx.layout, self.ops
        j = self.state_index
        conv_pool, ssm_pool = ctx.state_pool.conv[j], ctx.state_pool.temporal[j]
        gate, xbc, dt_raw = proj.split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
        if layout.decode is not None and layout.decode.rows.whole and self.decode_output:
            # decodes alone: the op finishes with the output stage (one kernel on the cpu
            # backend)
            return ops.mamba2_mixer_decode(
                xbc, dt_raw, conv_pool, ssm_pool, layout, weight, bias, self.activation,
                self.A_log, self.dt_bias, self.dt_limit, self.D, self.scan_shape,
                self._output(gate),
            )  # fmt: skip
        y = proj.new_empty((proj.shape[0], self.num_heads, self.head_dim))
        if layout.prefill is not None:
            rows = layout.prefill.rows
            conv_out = ops.conv1d_prefill(
                rows.take(xbc), weight, bias, conv_pool, layout, self.activation
            )
            x, b, c = split_xbc(conv_out, self.scan_shape)
            dt = process_dt(rows.take(dt_raw), self.dt_bias, self.dt_limit)
            A = -torch.exp(self.A_log.float())
            y = rows.put(y, ops.mamba2_prefill(x, dt, A, b, c, self.D, ssm_pool, layout))
        if layout.decode is not None:
            rows = layout.decode.rows
            step = ops.mamba2_mixer_decode(
                rows.take(xbc), rows.take(dt_raw), conv_pool, ssm_pool, layout, weight, bias,
                self.activation, self.A_log, self.dt_bias, self.dt_limit, self.D, self.scan_shape,
            )  # fmt: skip
            y = rows.put(y, step)
        y = y.view(-1, self.intermediate)
        if self.norm is not None:
            return self.norm(y, gate)
        return silu_gate(y, gate)

    def _output(self, gate: torch.Tensor) -> GatedNorm:
        """The output stage a decode op finishes with: the gate-first norm, or the bare gate
        (no norm: a ``GatedNorm`` without a weight)."""
        if self.norm is None:
            return GatedNorm(gate, None, 0.0, self.head_dim)  # (any group: nothing is summed)
        return self.norm.folded(gate)
