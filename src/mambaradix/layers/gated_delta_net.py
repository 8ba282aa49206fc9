"""Gated DeltaNet token mixer (Qwen3-Next and Qwen3.5) over the state pool.

Recurrent layer ``j`` reads each request's conv state ``state_pool.conv[j][slot]``
(``[conv_dim, K-1]``, pre-conv q|k|v inputs) and delta-rule state
``state_pool.temporal[j][slot]`` (``[Hv, Dk, Dv]``), and writes back the state after its new
tokens; ``(n, slot)`` snapshots get the state after the first n new tokens. Prefills run the
chunked kernel once per group of requests with the same chunk count; the same call returns the
states at the snapshot offsets (exact, anywhere in a chunk). Decodes run one batched step.

Projection layouts: ``"qwen3_next"`` packs ``in_proj_qkvz`` / ``in_proj_ba`` per key-head group;
``"qwen3_5"`` has separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. Both are
fused into one ``in_proj`` whose rows are regrouped at load (``regroup_in_proj``), so the
forward reads one layout.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaradix.core import StateLayerSpec
from mambaradix.kernels import get_kernel
from mambaradix.kernels.gated_delta import gdn_gates
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

    def regroup_in_proj(self, weight: torch.Tensor) -> torch.Tensor:
        """A checkpoint's fused ``in_proj`` weight (``GDN_MERGES`` order) with its rows in the
        order ``_project`` reads: ``q | k | v | z | b | a``, each head after head. ``qwen3_5``
        checkpoints already are; ``qwen3_next`` ones group q, k, v, z (and b, a) per key head,
        which cost a gather and a copy of every projection per forward."""
        if self.layout == "qwen3_5":
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

    def forward(self, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        ctx = layout.ctx
        pool = ctx.state_pool
        conv_pool, ssm_pool = pool.conv[self.state_layer], pool.temporal[self.state_layer]
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight.squeeze(1)
        core = torch.empty(x.shape[0], self.hv, self.dv, dtype=x.dtype, device=x.device)

        if layout.decode_reqs:
            rows, slots = layout.decode_rows, layout.decode_slots
            xs = mixed if layout.all_decode else mixed.index_select(0, rows)
            ad, bd = (a, b) if layout.all_decode else (a[rows], b[rows])
            o = get_kernel("gated_delta_decode")(
                xs, conv_pool, ssm_pool, slots, weight, self.conv1d.bias, ad, bd, self.A_log,
                self.dt_bias, self.hk, self.activation,
            )  # fmt: skip
            if layout.all_decode:
                core = o
            else:
                core[rows] = o
            self._decode_snapshots(layout, conv_pool, ssm_pool)

        if layout.prefill_reqs:
            g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
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
        dev = mixed.device
        lens = [ctx.extend_lens[i] for i in idx]
        starts = [ctx.starts[i] for i in idx]
        slot_t = torch.tensor([ctx.reqs[i].state_slot for i in idx], dtype=torch.long, device=dev)
        init_conv = conv_pool.index_select(0, slot_t)
        if len(idx) == 1:
            seg = mixed[starts[0] : starts[0] + lens[0]]
        else:
            seg = mixed.index_select(0, _rows(starts, lens, dev))
        conv_out = get_kernel("causal_conv1d")(
            seg, weight, self.conv1d.bias, init_conv, lens, self.activation
        )
        q_all, k_all, v_all = self._split_qkv(conv_out)
        offs = [0]
        for n in lens[:-1]:
            offs.append(offs[-1] + n)
        # One kernel call per group of requests with the same chunk count, right-padded with
        # no-op tokens (beta = 0, g = 0 leave the state unchanged). The state at a snapshot
        # offset comes out of the same call (``states_at``), wherever it falls.
        snaps = [(j, m, slot) for j, i in enumerate(idx) for m, slot in ctx.reqs[i].snapshots]
        init_state = ssm_pool.index_select(0, slot_t).float()
        final = torch.empty_like(init_state)
        snap_states: list[torch.Tensor | None] = [None] * len(snaps)
        buckets: dict[int, list[int]] = {}
        for j, n in enumerate(lens):
            buckets.setdefault(-(-n // self.chunk_size), []).append(j)
        chunk = get_kernel("chunk_gated_delta_rule")
        for members in buckets.values():
            row_of = {j: row for row, j in enumerate(members)}
            wanted = [(k, row_of[j], m) for k, (j, m, _) in enumerate(snaps) if j in row_of]
            width = max(lens[j] for j in members)
            mlens = [lens[j] for j in members]
            by_seg = _padded_rows([offs[j] for j in members], mlens, width, seg.shape[0], dev)
            by_batch = _padded_rows([starts[j] for j in members], mlens, width, g.shape[0], dev)
            o, new_state, picked = chunk(
                _take(q_all, by_seg),
                _take(k_all, by_seg),
                _take(v_all, by_seg),
                _take(g, by_batch),
                _take(beta, by_batch),
                init_state[members],
                self.chunk_size,
                states_at=[(row, m) for _, row, m in wanted],
            )
            keep = by_seg.view(-1) < seg.shape[0]
            dest = _rows([starts[j] for j in members], mlens, dev)
            core.index_copy_(0, dest, o.reshape(-1, *o.shape[2:])[keep].to(core.dtype))
            final[members] = new_state
            for (k, _, _), st in zip(wanted, picked):
                snap_states[k] = st
        ssm_pool.index_copy_(0, slot_t, final.to(ssm_pool.dtype))
        conv_pool.index_copy_(
            0, slot_t, _conv_states(seg, init_conv, offs, lens).to(conv_pool.dtype)
        )
        if snaps:
            snap_slots = torch.tensor([slot for _, _, slot in snaps], dtype=torch.long, device=dev)
            ssm_pool.index_copy_(0, snap_slots, torch.stack(snap_states).to(ssm_pool.dtype))
            conv = _conv_states(
                seg, init_conv, offs, [m for _, m, _ in snaps], [j for j, _, _ in snaps]
            )
            conv_pool.index_copy_(0, snap_slots, conv.to(conv_pool.dtype))


def _rows(starts: list[int], lens: list[int], device) -> torch.Tensor:
    """The row indices ``start .. start+len-1`` of every span, concatenated."""
    s, n = torch.tensor(starts), torch.tensor(lens)
    base = torch.repeat_interleave(s - (torch.cumsum(n, 0) - n), n)  # start minus span offset
    return (base + torch.arange(int(n.sum()))).to(device)


def _padded_rows(starts: list[int], lens: list[int], width: int, pad_row: int, device):
    """``[B, width]`` row indices of each span, right-padded with ``pad_row`` (a zero row)."""
    t = torch.arange(width)
    idx = torch.tensor(starts)[:, None] + t[None, :]
    return torch.where(t[None, :] < torch.tensor(lens)[:, None], idx, pad_row).to(device)


def _take(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` for ``rows`` ``[B, W]`` where the index ``len(x)`` reads zeros."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded.index_select(0, rows.reshape(-1)).view(*rows.shape, *x.shape[1:])


def _conv_states(
    seg: torch.Tensor,
    init_conv: torch.Tensor,
    offs: list[int],
    ns: list[int],
    owners: list[int] | None = None,
) -> torch.Tensor:
    """Conv states ``[P, C, K-1]`` after the first ``ns[p]`` new tokens of request
    ``owners[p]`` (default: request p), whose tokens start at row ``offs[owner]`` of ``seg``
    and whose carried-in state is ``init_conv[owner]``: ``conv_state_after`` for many at once.
    """
    owners = list(range(len(ns))) if owners is None else owners
    k1 = init_conv.shape[-1]
    if k1 == 0:
        return init_conv[owners]
    # rows of [carried-in states (K-1 per request) | seg]: a state is K-1 consecutive inputs
    carried = init_conv.to(seg.dtype).transpose(1, 2).reshape(-1, init_conv.shape[1])
    src = torch.cat([carried, seg])
    base = init_conv.shape[0] * k1
    t = torch.arange(k1)
    pos = torch.tensor(ns)[:, None] - k1 + t[None, :]  # position in the request's new tokens
    own = torch.tensor(owners)
    from_seg = base + torch.tensor(offs)[own][:, None] + pos
    from_init = own[:, None] * k1 + k1 + pos
    rows = torch.where(pos >= 0, from_seg, from_init).to(seg.device)
    return src.index_select(0, rows.reshape(-1)).view(len(ns), k1, -1).transpose(1, 2)
