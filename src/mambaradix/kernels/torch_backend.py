"""The ``torch`` backend: the reference every other backend is tested against (CPU or any
device torch runs on).

Its per-forward index (``TorchIndex``, built in ``prepare``) holds the index tensors the
reference kernels need beyond the layout: equal-chunk-count buckets of prefill segments for the
chunked delta rule, the Mamba2 chunk layout, the rows of every final and snapshot conv state,
the shared prefixes of prefills and the decode attention plan. Parts that depend on a layer's
shape (conv width, KV heads) are built by the first layer that asks and reused by every later
layer.

Decodes of several positions (a verify step, ``layout.DecodeRows``): the reference runs its
one-position decode step position after position (``_stepwise``: each position's states
carried in from the slot the position before wrote), so a backend's own one-position step
serves too; attention takes one query row per position over that row's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mambaradix.kernels import (
    attention,
    attention_plan,
    conv,
    fp8,
    gated_delta,
    mamba2,
    moe,
    norm,
    rope,
)
from mambaradix.kernels.activation import activation
from mambaradix.kernels.backend import KernelBackend, register_backend
from mambaradix.kernels.norm import GatedNorm
from mambaradix.layout import DecodeRows, ForwardLayout, PrefillSegments, decode_positions

Tensor = torch.Tensor
CHUNK_SIZE = 64  # the chunked scans' chunk (tokens)


@dataclass(slots=True)
class GdnBucket:
    """Prefill segments with the same chunk count, run as one right-padded batch."""

    members: torch.Tensor  # segment indices [B]
    rows: torch.Tensor  # [B, W] rows of the segments' tokens; Tp (a zero row) pads
    keep: torch.Tensor  # [B*W] bool: a real token
    dest: torch.Tensor  # their rows in segment order
    states_at: list[tuple[int, int]]  # (row in the bucket, offset) per snapshot in it
    snapshots: list[int]  # which snapshot each states_at entry is


class TorchIndex:
    """Per-forward index tensors of the reference kernels, each built once on first use."""

    __slots__ = ("layout", "backend", "_memo")

    def __init__(self, layout: ForwardLayout, backend: KernelBackend) -> None:
        self.layout = layout
        self.backend = backend
        self._memo: dict = {}

    def get(self, key: tuple, build: Callable[[], object]):
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


@register_backend("torch")
class TorchBackend(KernelBackend):
    # the per-call primitives; a subclass replaces those it has native code for
    gated_delta_step = staticmethod(gated_delta.gated_delta_decode)
    attention_decode = staticmethod(attention.attention_decode)
    linear = staticmethod(fp8.linear)  # F.linear; an fp8 weight dequantized first
    rms_norm = staticmethod(norm.rms_norm)
    add_rms_norm = staticmethod(norm.add_rms_norm)
    rms_norm_gated = staticmethod(norm.rms_norm_gated)
    rms_norm_gate_first = staticmethod(norm.rms_norm_gate_first)
    silu_gate = staticmethod(norm.silu_gate)  # (not an op: mamba2_mixer_decode's bare gate)
    rms_norm_rope = staticmethod(rope.rms_norm_rope)
    moe_pad = staticmethod(moe.moe_pad)
    moe_unpad = staticmethod(moe.moe_unpad)
    # whether the decode state ops step a decode of several positions in their own kernels
    # (else position after position, ``_stepwise``: its per-position index is built in the
    # forward, so such a step is not replayed)
    steps_positions: bool = False

    def prepare(self, layout: ForwardLayout) -> None:
        layout.meta = TorchIndex(layout, self)

    def moe_experts(self, x, weights, ids, gate_up, down, act, gated=True) -> Tensor:
        """``kernels.moe.moe_experts``: a padded batched GEMM over every expert for few pairs
        an expert, else one GEMM pair per expert with tokens."""
        return moe.moe_experts(self, x, weights, ids, gate_up, down, activation(act), 0, gated)

    def gated_mlp(self, x, gate_up, down, act) -> Tensor:
        """The composition: this backend's ``linear``, the activation, the product, ``linear``."""
        gate, up = self.linear(x, gate_up, None).chunk(2, dim=-1)
        return self.linear(activation(act)(gate) * up, down, None)

    def _index(self, layout: ForwardLayout) -> TorchIndex:
        index = layout.meta
        if not isinstance(index, TorchIndex) or index.backend is not self:
            self.prepare(layout)  # a layout no runner prepared (a test driving a model)
            index = layout.meta
        return index

    # ------------------------------------------------------------------ attention

    def store_kv(self, k, v, k_pool, v_pool, layout) -> None:
        k_pool.index_copy_(0, layout.out_kv_slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, layout.out_kv_slots, v.to(v_pool.dtype))

    def paged_attention_prefill(self, q, k_pool, v_pool, layout, scale) -> Tensor:
        seg, cu = layout.prefill, layout.prefill.cu_list
        out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
        grouped: set[int] = set()
        groups = self._index(layout).get(("prefill_groups",), lambda: _prefill_groups(seg))
        for members, shared_len in groups:
            outs = attention.attention_prefill_shared(
                [q[cu[p] : cu[p + 1]] for p in members],
                k_pool,
                v_pool,
                [seg.kv_slots[p] for p in members],
                [seg.prefix_lens[p] for p in members],
                shared_len,
                scale,
            )
            for p, o in zip(members, outs):
                out[cu[p] : cu[p + 1]] = o
            grouped.update(members)
        for p in range(len(seg.lens)):
            if p not in grouped:
                out[cu[p] : cu[p + 1]] = attention.attention_prefill(
                    q[cu[p] : cu[p + 1]], k_pool, v_pool, seg.kv_slots[p], seg.prefix_lens[p],
                    scale,
                )  # fmt: skip
        return out

    def paged_attention_decode(self, q, k_pool, v_pool, layout, scale) -> Tensor:
        dec = layout.decode
        plan = self._decode_attention_plan(layout, k_pool.shape[1])
        return self.attention_decode(q, k_pool, v_pool, dec.kv_table, dec.seq_lens, scale, plan)

    def _decode_attention_plan(self, layout, heads: int) -> attention_plan.DecodePlan:
        return self._index(layout).get(("decode_plan", heads), lambda: _decode_plan(layout, heads))

    def replay_key(self, layout, num_kv_heads):
        """The decode attention plan's structure: for each shared-prefix piece its prefix
        length, groups and padded width, and how many requests have one (these shape the
        pieces' attention); () without pieces. The reference's own attention reads its plan's
        spans in Python, so only a backend whose ``attention_decode`` does not (the ``cpu``
        one) replays steps with attention; and only one that ``steps_positions`` replays a
        decode of several positions."""
        if layout.decode is not None and layout.decode.multi and not self.steps_positions:
            return None
        if layout.decode is None or layout.decode.kv_table is None or not num_kv_heads:
            return ()
        if type(self).attention_decode is TorchBackend.attention_decode:
            return None
        plan = self._decode_attention_plan(layout, num_kv_heads)
        if not plan.pieces:
            return ()
        members = plan.shared_members.numel()
        return (*((p.plen, p.n, p.width) for p in plan.pieces), members)

    def write_replay_inputs(self, recorded, layout) -> None:
        for key, plan in self._index(layout)._memo.items():
            if key[0] != "decode_plan":
                continue
            into = self._index(recorded)._memo[key]
            pairs = [(into.begin, plan.begin), (into.shared_row, plan.shared_row),
                     (into.shared_members, plan.shared_members)]  # fmt: skip
            for a, b in zip(into.pieces, plan.pieces):
                pairs += [(a.queries, b.queries), (a.kv_rows, b.kv_rows)]
            for dst, src in pairs:
                if dst is not src:
                    dst.copy_(src)

    # ------------------------------------------------------------------ conv

    def conv1d_prefill(self, x, weight, bias, conv_pool, layout, activation) -> Tensor:
        seg = layout.prefill
        init = conv_pool.index_select(0, seg.state_slots)
        y = conv.causal_conv1d(x, weight, bias, init, seg.lens, activation)
        self._store_conv_states(x, init, conv_pool, layout)
        return y

    def _store_conv_states(self, x, init, conv_pool, layout) -> None:
        """Write every segment's final conv state and every snapshot's from ``x`` (the conv
        inputs) and the carried-in states ``init``, in one gather."""
        seg = layout.prefill
        k1 = init.shape[-1]
        if k1 == 0:
            return
        rows, dest = self._index(layout).get(("conv_rows", k1), lambda: _conv_rows(seg, k1))
        carried = init.to(x.dtype).transpose(1, 2).reshape(-1, init.shape[1])
        src = torch.cat([carried, x])
        states = src.index_select(0, rows).view(-1, k1, x.shape[1]).transpose(1, 2)
        conv_pool.index_copy_(0, dest, states.to(conv_pool.dtype))

    def conv1d_decode(self, x, weight, bias, conv_pool, layout, activation) -> Tensor:
        dec = layout.decode
        if dec.multi:
            return self._stepwise(
                layout, (conv_pool,), (x,),
                lambda x, one: self.conv1d_decode(x, weight, bias, conv_pool, one, activation),
            )  # fmt: skip
        states = conv_pool.index_select(0, dec.state_slots)
        y, new = conv.causal_conv1d_update(x, states, weight, bias, activation)
        _store_decode_states(conv_pool, dec, new)
        return y

    # ------------------------------------------------------------------ Gated DeltaNet

    def gdn_prefill(self, q, k, v, g, beta, ssm_pool, layout) -> Tensor:
        seg = layout.prefill
        init = ssm_pool.index_select(0, seg.state_slots).float()
        final = torch.empty_like(init)
        out = v.new_empty(v.shape)
        snaps: list[Tensor | None] = [None] * seg.num_snapshots
        buckets = self._index(layout).get(("gdn_buckets",), lambda: _gdn_buckets(seg, self.device))
        for b in buckets:
            o, new_state, picked = gated_delta.chunk_gated_delta_rule(
                _take(q, b.rows), _take(k, b.rows), _take(v, b.rows), _take(g, b.rows),
                _take(beta, b.rows), init.index_select(0, b.members), CHUNK_SIZE,
                states_at=b.states_at,
            )  # fmt: skip
            out.index_copy_(0, b.dest, o.reshape(-1, *o.shape[2:])[b.keep].to(out.dtype))
            final.index_copy_(0, b.members, new_state)
            for k_, st in zip(b.snapshots, picked):
                snaps[k_] = st
        ssm_pool.index_copy_(0, seg.state_slots, final.to(ssm_pool.dtype))
        if snaps:
            ssm_pool.index_copy_(0, seg.snapshot_slots, torch.stack(snaps).to(ssm_pool.dtype))
        return out

    def gdn_decode(self, x, a, b, conv_pool, ssm_pool, layout, conv_weight, conv_bias, A_log,
                   dt_bias, num_k_heads, activation, norm=None,
                   beta_scale=1.0) -> Tensor:  # fmt: skip
        dec = layout.decode
        if dec.multi:
            return self._stepwise(
                layout, (conv_pool, ssm_pool), (x, a, b, None if norm is None else norm.gate),
                lambda x, a, b, gate, one: self.gdn_decode(
                    x, a, b, conv_pool, ssm_pool, one, conv_weight, conv_bias, A_log, dt_bias,
                    num_k_heads, activation, _with_gate(norm, gate), beta_scale,
                ),
            )  # fmt: skip
        out = self.gated_delta_step(
            x, conv_pool, ssm_pool, dec.state_slots, conv_weight, conv_bias, a, b, A_log,
            dt_bias, num_k_heads, activation, beta_scale=beta_scale,
        )  # fmt: skip
        for pool in (conv_pool, ssm_pool):
            _copy_decode_snapshots(pool, dec)
        if norm is None:
            return out
        return self.rms_norm_gated(out, norm.gate.reshape(out.shape), norm.weight, norm.eps)

    # ------------------------------------------------------------------ Mamba2

    def mamba2_prefill(self, x, dt, A, B, C, D, ssm_pool, layout) -> Tensor:
        seg = layout.prefill
        chunks = self._index(layout).get(
            ("mamba2_chunks",), lambda: _mamba2_chunks(seg, self.device)
        )
        init = ssm_pool.index_select(0, seg.state_slots)
        y, final, snaps = mamba2.mamba2_chunk_scan(x, dt, A, B, C, D, init, chunks)
        ssm_pool.index_copy_(0, seg.state_slots, final.to(ssm_pool.dtype))
        if seg.num_snapshots:
            ssm_pool.index_copy_(0, seg.snapshot_slots, snaps.to(ssm_pool.dtype))
        return y

    def mamba2_decode(self, x, dt, A, B, C, D, ssm_pool, layout) -> Tensor:
        dec = layout.decode
        if dec.multi:
            return self._stepwise(
                layout, (ssm_pool,), (x, dt, B, C),
                lambda x, dt, B, C, one: self.mamba2_decode(x, dt, A, B, C, D, ssm_pool, one),
            )  # fmt: skip
        y, new = mamba2.mamba2_step(ssm_pool.index_select(0, dec.state_slots), x, dt, A, B, C, D)
        _store_decode_states(ssm_pool, dec, new)
        return y

    def mamba2_mixer_decode(self, xbc, dt_raw, conv_pool, ssm_pool, layout, conv_weight,
                            conv_bias, activation, A_log, dt_bias, dt_limit, D, shape,
                            norm=None) -> Tensor:  # fmt: skip
        """The composition: this backend's conv step, dt, then its scan step (and its norm)."""
        conv_out = self.conv1d_decode(xbc, conv_weight, conv_bias, conv_pool, layout, activation)
        x, B, C = mamba2.split_xbc(conv_out, shape)
        dt = mamba2.process_dt(dt_raw, dt_bias, dt_limit)
        A = -torch.exp(A_log.float())
        y = self.mamba2_decode(x, dt, A, B, C, D, ssm_pool, layout).to(xbc.dtype)
        if norm is None:
            return y
        if norm.weight is None:
            return self.silu_gate(y.view(y.shape[0], -1), norm.gate)
        return self.rms_norm_gate_first(
            y.view(y.shape[0], -1), norm.gate, norm.weight, norm.eps, norm.group_size
        )

    def _stepwise(
        self,
        layout: ForwardLayout,
        pools: tuple[Tensor, ...],
        rows: tuple[Tensor | None, ...],
        step: Callable[..., Tensor],
    ) -> Tensor:
        """A decode op over decodes of several positions as its one-position form ``step(*rows
        of this position, layout of this position)``, position after position: before each,
        the states it starts from are copied into the slots it writes (the working slot's
        for the first position, the previous position's slot after it), so the step runs in
        place there; then the snapshots no row writes are copied. ``rows``: the op's per-row
        inputs (None passes through). Returns the step's outputs in the decode rows' order."""
        dec = layout.decode
        out = None
        for pos in decode_positions(layout):
            if pos.copy_src.numel():
                for pool in pools:
                    pool.index_copy_(0, pos.copy_dst, pool.index_select(0, pos.copy_src))
            y = step(*(None if t is None else pos.rows.take(t) for t in rows), pos.layout)
            if out is None:
                out = y.new_empty(dec.rows.count, *y.shape[1:])
            out = pos.rows.put(out, y)
        for pool in pools:
            _copy_decode_snapshots(pool, dec)
        return out


def _with_gate(norm: GatedNorm | None, gate: Tensor | None) -> GatedNorm | None:
    """``norm`` over the gate rows ``gate`` (one position's of a decode of several)."""
    return None if norm is None else GatedNorm(gate, norm.weight, norm.eps, norm.group_size)


# --------------------------------------------------------------------------- index tensors


def _copy_decode_snapshots(pool: Tensor, dec: DecodeRows) -> None:
    """After an in-place decode step: the snapshots no row wrote (a decode's state after its
    last token, in its working slot)."""
    if dec.num_copies:
        pool.index_copy_(0, dec.snapshot_slots, pool.index_select(0, dec.snapshot_src))


def _store_decode_states(pool: Tensor, dec: DecodeRows, new: Tensor) -> None:
    """The decodes' new states into their working slots and their snapshot slots."""
    pool.index_copy_(0, dec.state_slots, new.to(pool.dtype))
    if dec.num_copies:
        pool.index_copy_(
            0, dec.snapshot_slots, new.index_select(0, dec.snapshot_rows).to(pool.dtype)
        )


def _conv_rows(seg: PrefillSegments, k1: int) -> tuple[Tensor, Tensor]:
    """Rows of ``[carried-in states (K-1 rows per segment) | prefill rows]`` holding every
    segment's final conv state then every snapshot's (K-1 consecutive inputs each), and the
    slots they go to."""
    ns = seg.lens + seg.snapshot_offsets
    owners = list(range(len(seg.lens))) + seg.snapshot_seqs
    t = torch.arange(k1)
    pos = torch.tensor(ns)[:, None] - k1 + t[None, :]  # position among the owner's new tokens
    own = torch.tensor(owners)
    from_seg = len(seg.lens) * k1 + torch.tensor(seg.cu_list[:-1])[own][:, None] + pos
    from_init = own[:, None] * k1 + k1 + pos
    rows = torch.where(pos >= 0, from_seg, from_init).reshape(-1)
    dest = torch.cat([seg.state_slots, seg.snapshot_slots])
    return rows.to(seg.state_slots.device), dest


def _gdn_buckets(seg: PrefillSegments, device: torch.device) -> list[GdnBucket]:
    """Group the segments by chunk count (padding tokens with g = beta = 0 leave the state
    unchanged, so a segment padded to its bucket's width ends in the same state)."""
    by_count: dict[int, list[int]] = {}
    for p, n in enumerate(seg.lens):
        by_count.setdefault(-(-n // CHUNK_SIZE), []).append(p)
    pad = seg.num_tokens
    buckets = []
    for members in by_count.values():
        row_of = {p: r for r, p in enumerate(members)}
        width = max(seg.lens[p] for p in members)
        t = torch.arange(width)
        starts = torch.tensor([seg.cu_list[p] for p in members])
        lens = torch.tensor([seg.lens[p] for p in members])
        rows = torch.where(t[None, :] < lens[:, None], starts[:, None] + t[None, :], pad)
        picks = [(k, s, n) for k, (s, n) in enumerate(zip(seg.snapshot_seqs, seg.snapshot_offsets))
                 if s in row_of]  # fmt: skip
        dest = torch.cat([torch.arange(seg.cu_list[p], seg.cu_list[p + 1]) for p in members])
        buckets.append(
            GdnBucket(
                members=torch.tensor(members, device=device),
                rows=rows.to(device),
                keep=(rows.reshape(-1) < pad).to(device),
                dest=dest.to(device),
                states_at=[(row_of[s], n) for _, s, n in picks],
                snapshots=[k for k, _, _ in picks],
            )
        )
    return buckets


def _take(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]`` for ``rows`` ``[B, W]`` where the index ``len(x)`` reads zeros."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    return padded.index_select(0, rows.reshape(-1)).view(*rows.shape, *x.shape[1:])


def _mamba2_chunks(seg: PrefillSegments, device: torch.device) -> mamba2.ChunkLayout:
    offsets = [seg.snapshot_offsets_of(p) for p in range(len(seg.lens))]
    return mamba2.ChunkLayout.build(seg.lens, offsets, CHUNK_SIZE, device)


def _prefill_groups(seg: PrefillSegments) -> list[tuple[list[int], int]]:
    """Prefills whose cached prefixes start with the same KV slots, as ``(segments, shared
    length)`` (``attention_plan.shared_prefixes`` over the cached parts)."""
    cand = [p for p, n in enumerate(seg.prefix_lens) if n >= attention_plan.MIN_SHARED]
    if len(cand) < 2:
        return []
    rows = [seg.kv_slots[p][: seg.prefix_lens[p]] for p in cand]
    table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    # length prefix_len + 1: a shared part never goes past a member's cached prefix
    lens = torch.tensor([len(x) + 1 for x in rows])
    return [
        ([cand[j] for j in members.tolist()], shared_len)
        for members, shared_len in attention_plan.shared_prefixes(table.to(torch.long), lens)
    ]


def _decode_plan(layout: ForwardLayout, heads: int) -> attention_plan.DecodePlan:
    """The decodes' attention plan; the previous forward's (in ``layout.carry``) is reused
    when it still fits (a decode step after a decode step)."""
    dec, carry = layout.decode, layout.carry
    key = ("decode_plan", heads)
    previous = carry.get(key) if carry is not None else None
    groups = _request_groups(dec) if dec.multi else None
    plan = attention_plan.decode_plan(
        dec.kv_table, dec.seq_lens, heads, groups=groups, previous=previous
    )
    if carry is not None:
        carry[key] = plan
    return plan


def _request_groups(dec: DecodeRows) -> list[tuple[Tensor, int]]:
    """The shared prefixes of decodes of several positions: found between requests (their
    first rows), each group then holding all its requests' rows. A request's own rows are not a
    group of their own: the piece they share, their prefix, grows every step, and the plan's
    structure must not (a step graph is keyed by it)."""
    cu = dec.cu.tolist()
    first = dec.cu[:-1]
    groups = attention_plan.shared_prefixes(
        dec.kv_table.index_select(0, first), dec.seq_lens.index_select(0, first)
    )
    return [
        (torch.cat([torch.arange(cu[k], cu[k + 1]) for k in members.tolist()]), plen)
        for members, plen in groups
    ]
