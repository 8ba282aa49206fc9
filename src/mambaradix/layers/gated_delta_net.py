"""Gated DeltaNet token mixer (Qwen3-Next and Qwen3.5) over the state pool.

Recurrent layer ``j`` reads each request's conv state ``state_pool.conv[j][slot]``
(``[conv_dim, K-1]``, pre-conv q|k|v inputs) and delta-rule state
``state_pool.temporal[j][slot]`` (``[Hv, Dk, Dv]``), and writes back the state after its new
tokens; ``(n, slot)`` snapshots get the state after the first n new tokens. Prefills run the
chunked kernel once per group of requests with the same chunk count; the same call returns the
states at the snapshot offsets (exact, anywhere in a chunk). Decodes run one batched step.

Projection layouts: ``"qwen3_next"`` packs ``in_proj_qkvz`` / ``in_proj_ba`` per key-head group;
``"qwen3_5"`` has separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaradix.core import StateLayerSpec
from mambaradix.kernels import get_kernel
from mambaradix.kernels.conv import conv_state_after
from mambaradix.layers.attention import BatchLayout
from mambaradix.layers.norm import GatedRMSNorm

GDN_MERGES = {
    "qwen3_next": {"in_proj": ("in_proj_qkvz", "in_proj_ba")},
    "qwen3_5": {"in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
}


class GatedDeltaNet(nn.Module):
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
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        if layout not in ("qwen3_next", "qwen3_5"):
            raise ValueError(f"unknown Gated DeltaNet projection layout {layout!r}")
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.state_layer = state_layer
        self.layout = layout
        self.activation = activation
        self.chunk_size = chunk_size
        # All input projections in one GEMM (``in_proj``): the HF linears stacked in the order
        # of GDN_MERGES[layout]; both layouts have qkv(z) then b/a parts.
        self.in_proj = nn.Linear(
            hidden, self.conv_dim + self.value_dim + 2 * num_v_heads, bias=False
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def state_layer_spec(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> StateLayerSpec:
        return StateLayerSpec(
            conv_shape=(self.conv_dim, self.conv_kernel - 1),
            temporal_shape=(self.hv, self.dk, self.dv),
            conv_dtype=conv_dtype,
            temporal_dtype=ssm_dtype,
        )

    def _project(self, x: torch.Tensor):
        """-> mixed_qkv [T, conv_dim] (q|k|v flat), z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        T = x.shape[0]
        proj = self.in_proj(x)
        if self.layout == "qwen3_5":
            mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
            return mixed, z.reshape(T, self.hv, self.dv), b, a
        r = self.hv // self.hk
        qkvz, ba = proj.split([self.conv_dim + self.value_dim, 2 * self.hv], dim=-1)
        qkvz = qkvz.reshape(T, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        ba = ba.reshape(T, self.hk, 2 * r)
        b, a = ba[..., :r].reshape(T, self.hv), ba[..., r:].reshape(T, self.hv)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, self.hv, self.dv), b, a

    def _split_qkv(self, mixed: torch.Tensor):
        T = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(T, self.hk, self.dk),
            k.reshape(T, self.hk, self.dk),
            v.reshape(T, self.hv, self.dv),
        )

    def forward(self, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        ctx = layout.ctx
        pool = ctx.state_pool
        conv_pool, ssm_pool = pool.conv[self.state_layer], pool.temporal[self.state_layer]
        mixed, z, b, a = self._project(x)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        weight = self.conv1d.weight.squeeze(1)
        core = torch.empty(x.shape[0], self.hv, self.dv, dtype=x.dtype, device=x.device)

        if layout.decode_reqs:
            rows, slots = layout.decode_rows, layout.decode_slots
            xs = mixed if layout.all_decode else mixed.index_select(0, rows)
            gd, bd = (g, beta) if layout.all_decode else (g[rows], beta[rows])
            o = get_kernel("gated_delta_decode")(
                xs, conv_pool, ssm_pool, slots, weight, self.conv1d.bias, gd, bd, self.hk,
                self.activation,
            )  # fmt: skip
            if layout.all_decode:
                core = o
            else:
                core[rows] = o
            self._decode_snapshots(layout, conv_pool, ssm_pool)

        if layout.prefill_reqs:
            self._prefill(layout, mixed, g, beta, core, conv_pool, ssm_pool, weight)

        out = self.norm(core, z)
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))

    def _decode_snapshots(self, layout: BatchLayout, conv_pool, ssm_pool) -> None:
        src, dst = [], []
        for i in layout.decode_reqs:
            r = layout.ctx.reqs[i]
            for _, slot in r.snapshots:  # n can only be 1
                src.append(r.state_slot)
                dst.append(slot)
        if src:
            s = torch.tensor(src, dtype=torch.long, device=conv_pool.device)
            d = torch.tensor(dst, dtype=torch.long, device=conv_pool.device)
            conv_pool.index_copy_(0, d, conv_pool.index_select(0, s))
            ssm_pool.index_copy_(0, d, ssm_pool.index_select(0, s))

    def _prefill(self, layout, mixed, g, beta, core, conv_pool, ssm_pool, weight) -> None:
        ctx = layout.ctx
        idx = layout.prefill_reqs
        lens = [ctx.extend_lens[i] for i in idx]
        starts = [ctx.starts[i] for i in idx]
        slots = [ctx.reqs[i].state_slot for i in idx]
        slot_t = torch.tensor(slots, dtype=torch.long, device=mixed.device)
        init_conv = conv_pool.index_select(0, slot_t)
        if len(idx) == 1:
            seg = mixed[starts[0] : starts[0] + lens[0]]
        else:
            seg = torch.cat([mixed[s : s + n] for s, n in zip(starts, lens)])
        conv_out = get_kernel("causal_conv1d")(
            seg, weight, self.conv1d.bias, init_conv, lens, self.activation
        )
        q_all, k_all, v_all = self._split_qkv(conv_out)
        # One kernel call per group of requests with the same chunk count, right-padded with
        # no-op tokens (beta = 0, g = 0 leave the state unchanged). The state at a snapshot
        # offset comes out of the same call (``states_at``), wherever it falls.
        offs = [0]
        for n in lens[:-1]:
            offs.append(offs[-1] + n)
        # states_at[j]: request j's snapshot offsets (inside its new tokens) -> state
        states_at = [
            dict.fromkeys(sorted({m for m, _ in ctx.reqs[i].snapshots if 0 < m < lens[j]}))
            for j, i in enumerate(idx)
        ]
        state = [ssm_pool[sl].float() for sl in slots]
        chunk = get_kernel("chunk_gated_delta_rule")
        buckets: dict[int, list[int]] = {}
        for j, n in enumerate(lens):
            buckets.setdefault(-(-n // self.chunk_size), []).append(j)
        for members in buckets.values():
            self._run_group(
                chunk, members, lens, offs, starts, q_all, k_all, v_all, g, beta, state,
                states_at, core,
            )  # fmt: skip
        for j, i in enumerate(idx):
            r, n, off = ctx.reqs[i], lens[j], offs[j]
            x_in = seg[off : off + n]
            for m, slot in r.snapshots:
                conv_pool[slot] = conv_state_after(x_in, init_conv[j], m).to(conv_pool.dtype)
                ssm_pool[slot] = (state[j] if m == n else states_at[j][m]).to(ssm_pool.dtype)
            conv_pool[slots[j]] = conv_state_after(x_in, init_conv[j], n).to(conv_pool.dtype)
            ssm_pool[slots[j]] = state[j].to(ssm_pool.dtype)

    def _run_group(
        self, chunk, members, lens, offs, starts, q_all, k_all, v_all, g, beta, state,
        states_at, core,
    ) -> None:  # fmt: skip
        """One batched kernel call over all new tokens of the ``members`` requests; records
        their final states and the states at their snapshot offsets."""
        width = max(lens[j] for j in members)

        def stack(x: torch.Tensor, base: list[int]) -> torch.Tensor:
            rows = []
            for j in members:
                piece = x[base[j] : base[j] + lens[j]]
                pad = [0, 0] * (piece.dim() - 1) + [0, width - lens[j]]
                rows.append(F.pad(piece, pad))
            return torch.stack(rows)

        wanted = [(row, m) for row, j in enumerate(members) for m in states_at[j]]
        o, new_state, *picked = chunk(
            stack(q_all, offs),
            stack(k_all, offs),
            stack(v_all, offs),
            stack(g, starts),
            stack(beta, starts),
            torch.stack([state[j] for j in members]),
            self.chunk_size,
            states_at=wanted or None,
        )
        for row, j in enumerate(members):
            core[starts[j] : starts[j] + lens[j]] = o[row, : lens[j]]
            state[j] = new_state[row]
        for (row, m), st in zip(wanted, picked[0] if picked else ()):
            states_at[members[row]][m] = st
