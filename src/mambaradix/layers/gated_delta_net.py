"""Gated DeltaNet token mixer (Qwen3-Next and Qwen3.5) over the state pool.

Recurrent layer ``j`` reads each request's conv state ``state_pool.conv[j][slot]``
(``[conv_dim, K-1]``, pre-conv q|k|v inputs) and delta-rule state
``state_pool.temporal[j][slot]`` (``[Hv, Dk, Dv]``), and writes back the state after its new
tokens; ``(n, slot)`` snapshots get the state after the first n new tokens. The layer projects
and gates; its backend (``self.ops``) runs the conv and the delta rule over the prefill segments
and the decodes of the forward's layout, states in the pool.

Projection layouts: ``"qwen3_next"`` packs ``in_proj_qkvz`` / ``in_proj_ba`` per key-head group;
``"qwen3_5"`` has separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``;
``"olmo_hybrid"`` one linear each (``q_proj`` ... ``a_proj``, the gate ``g_proj``). All are fused
into one ``in_proj`` whose rows are regrouped at load (``regroup_in_proj``), so the forward reads
one layout. ``beta_scale`` 2 (OLMo-Hybrid's ``linear_allow_neg_eigval``) doubles the write
strength, so the state's transition can have negative eigenvalues.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaradix.core import StateLayerSpec
from mambaradix.kernels.gated_delta import gdn_gates
from mambaradix.layers.norm import GatedRMSNorm
from mambaradix.layers.ops import KernelUser, Linear
from mambaradix.layout import ForwardContext

GDN_MERGES = {
    "qwen3_next": {"in_proj": ("in_proj_qkvz", "in_proj_ba")},
    "qwen3_5": {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
    "olmo_hybrid": {"in_proj": ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")},
}


class GatedDeltaNet(KernelUser, nn.Module):
    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        state_layer: int,
        eps: float = 1e-6,
        layout: str = "qwen3_next",
        activation: str = "silu",
        beta_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if layout not in GDN_MERGES:
            raise ValueError(f"unknown Gated DeltaNet projection layout {layout!r}")
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.state_layer = state_layer
        self.layout = layout
        self.activation = activation
        self.beta_scale = float(beta_scale)
        # All input projections in one GEMM (``in_proj``): the HF linears stacked in the order
        # of GDN_MERGES[layout]; both layouts have qkv(z) then b/a parts.
        self.in_proj = Linear(hidden, self.conv_dim + self.value_dim + 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=eps, norm_before_gate=True)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)

    def state_layer_spec(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> StateLayerSpec:
        return StateLayerSpec(
            conv_shape=(self.conv_dim, self.conv_kernel - 1),
            temporal_shape=(self.hv, self.dk, self.dv),
            conv_dtype=conv_dtype,
            temporal_dtype=ssm_dtype,
        )

    def regroup_in_proj(self, weight: torch.Tensor) -> torch.Tensor:
        """A checkpoint's fused ``in_proj`` weight (``GDN_MERGES`` order) with its rows in the
        order ``_project`` reads: ``q | k | v | z | b | a``, each head after head. ``qwen3_5``
        and ``olmo_hybrid`` checkpoints already are; ``qwen3_next`` ones group q, k, v, z (and
        b, a) per key head, which cost a gather and a copy of every projection per forward."""
        if self.layout != "qwen3_next":
            return weight
        r, dk, dv = self.hv // self.hk, self.dk, self.dv
        group = 2 * dk + 2 * r * dv
        idx = torch.arange(self.hk * group).view(self.hk, group)
        q, k, v, z = idx.split([dk, dk, r * dv, r * dv], dim=1)
        ba = (self.hk * group + torch.arange(2 * self.hv)).view(self.hk, 2 * r)
        order = [t.reshape(-1) for t in (q, k, v, z, ba[:, :r], ba[:, r:])]
        return weight.index_select(0, torch.cat(order))

    def _project(self, x: torch.Tensor):
        """-> mixed_qkv [T, conv_dim] (q|k|v flat), z [T, Hv, Dv], b [T, Hv], a [T, Hv]: views of
        one GEMM (``in_proj`` rows are in this order, see ``regroup_in_proj``)."""
        mixed, z, b, a = self.in_proj(x).split(
            [self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1
        )
        return mixed, z.reshape(x.shape[0], self.hv, self.dv), b, a

    def _split_qkv(self, mixed: torch.Tensor):
        T = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(T, self.hk, self.dk),
            k.reshape(T, self.hk, self.dk),
            v.reshape(T, self.hv, self.dv),
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        layout, ops = ctx.layout, self.ops
        pool = ctx.state_pool
        conv_pool, ssm_pool = pool.conv[self.state_layer], pool.temporal[self.state_layer]
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight.squeeze(1)
        if layout.decode is not None and layout.decode.rows.whole:
            # decodes alone: the op finishes with the output norm (one kernel on the cpu backend)
            o = ops.gdn_decode(
                mixed, a, b, conv_pool, ssm_pool, layout, weight, self.conv1d.bias, self.A_log,
                self.dt_bias, self.hk, self.activation, self.norm.folded(z.flatten(1)),
                self.beta_scale,
            )  # fmt: skip
            return self.out_proj(o.reshape(x.shape[0], self.value_dim))
        core = torch.empty(x.shape[0], self.hv, self.dv, dtype=x.dtype, device=x.device)
        if layout.decode is not None:
            rows = layout.decode.rows
            o = ops.gdn_decode(
                rows.take(mixed), rows.take(a), rows.take(b), conv_pool, ssm_pool, layout,
                weight, self.conv1d.bias, self.A_log, self.dt_bias, self.hk, self.activation,
                None, self.beta_scale,
            )  # fmt: skip
            core = rows.put(core, o)
        if layout.prefill is not None:
            rows = layout.prefill.rows
            conv_out = ops.conv1d_prefill(
                rows.take(mixed), weight, self.conv1d.bias, conv_pool, layout, self.activation
            )
            q, k, v = self._split_qkv(conv_out)
            g, beta = gdn_gates(
                rows.take(a), rows.take(b), self.A_log, self.dt_bias, self.beta_scale
            )
            core = rows.put(core, ops.gdn_prefill(q, k, v, g, beta, ssm_pool, layout))
        out = self.norm(core, z)
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))
