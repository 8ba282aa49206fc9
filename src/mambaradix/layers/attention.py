"""Attention over the pooled KV, and ``BatchLayout``: the per-forward split of a mixed batch.

A forward mixes prefills (``extend_len > 1``) and decodes (``extend_len == 1``). Layers handle
decodes in one batched op and prefills per request (attention; prefills sharing a cached
prefix as one cascade group) or per round (recurrent).
``BatchLayout`` is built once per forward by the model and passed to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mambaradix.core import ForwardContext
from mambaradix.kernels import get_kernel
from mambaradix.kernels.attention_plan import (
    MIN_SHARED,
    DecodePlan,
    decode_plan,
    shared_prefixes,
)


@dataclass(slots=True)
class BatchLayout:
    """Where each request's rows are, split into decodes and prefills.

    ``decode_reqs`` / ``prefill_reqs`` are request indices; ``decode_rows`` the packed row of
    each decode token (tensor); ``decode_slots`` the working state slots of the decodes (tensor).
    The decode KV slot table is built on first use (models without attention never build it).
    """

    ctx: ForwardContext
    decode_reqs: list[int]
    prefill_reqs: list[int]
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    _slot_table: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _decode_plan: tuple[int, DecodePlan] | None = field(default=None, repr=False)
    _prefill_groups: list | None = field(default=None, repr=False)

    @classmethod
    def build(cls, ctx: ForwardContext) -> BatchLayout:
        decode = [i for i, n in enumerate(ctx.extend_lens) if n == 1]
        prefill = [i for i, n in enumerate(ctx.extend_lens) if n > 1]
        dev = ctx.input_ids.device
        if len(decode) == ctx.num_reqs:
            rows = torch.arange(len(decode), device=dev)
            slots = ctx.state_slots
        else:
            rows = torch.tensor([ctx.starts[i] for i in decode], dtype=torch.long, device=dev)
            slots = ctx.state_slots[torch.tensor(decode, dtype=torch.long, device=dev)]
        return cls(ctx, decode, prefill, rows, slots)

    @property
    def all_decode(self) -> bool:
        return not self.prefill_reqs

    def decode_slot_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot_table [Bd, L], seq_lens [Bd])`` for the decodes; entries past a request's
        length are any valid slot."""
        if self._slot_table is None:
            ctx = self.ctx
            dev = ctx.input_ids.device
            lens = [ctx.reqs[i].seq_len for i in self.decode_reqs]
            given = ctx.decode_table
            if given is not None and given.shape[0] == len(self.decode_reqs):
                table = given  # the scheduler's gather (decodes come first in the batch)
            else:
                seqs = [ctx.reqs[i].kv_slots[:n] for i, n in zip(self.decode_reqs, lens)]
                table = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
            lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
            self._slot_table = (table.to(device=dev, dtype=torch.long), lens_t)
        return self._slot_table

    def decode_plan(self, num_kv_heads: int) -> DecodePlan:
        """The decodes' attention plan (``kernels.attention_plan.decode_plan``: cascade groups and
        gather rows), once per forward for all attention layers. The previous forward's plan
        (in ``ctx.carry``) is reused when it still fits (a decode step after a decode step)."""
        if self._decode_plan is None or self._decode_plan[0] != num_kv_heads:
            carry = self.ctx.carry
            key = ("decode_plan", num_kv_heads)
            previous = carry.get(key) if carry is not None else None
            plan = decode_plan(*self.decode_slot_table(), num_kv_heads, previous=previous)
            if carry is not None:
                carry[key] = plan
            self._decode_plan = (num_kv_heads, plan)
        return self._decode_plan[1]

    def prefill_groups(self) -> list[tuple[list[int], int]]:
        """Prefills whose cached prefixes start with the same KV slots, as ``(request indices,
        shared length)`` (``kernels.attention_plan.shared_prefixes`` over the cached parts), once
        per forward."""
        if self._prefill_groups is None:
            ctx = self.ctx
            cand = [i for i in self.prefill_reqs if ctx.reqs[i].prefix_len >= MIN_SHARED]
            self._prefill_groups = []
            if len(cand) > 1:
                rows = [ctx.reqs[i].kv_slots[: ctx.reqs[i].prefix_len] for i in cand]
                table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
                # length prefix_len + 1: a shared part never goes past a member's cached prefix
                lens = torch.tensor([len(x) + 1 for x in rows])
                for members, plen in shared_prefixes(table.to(torch.long), lens):
                    self._prefill_groups.append(([cand[j] for j in members.tolist()], plen))
        return self._prefill_groups


def pooled_attention(
    layout: BatchLayout,
    attn_layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write the new tokens' K/V into attention layer ``attn_layer`` of the pool and attend.

    ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` for all packed new tokens (RoPE applied).
    Returns ``[T, Hq, Dv]``.
    """
    ctx = layout.ctx
    pool = ctx.kv_pool
    k_pool, v_pool = pool.k[attn_layer], pool.v[attn_layer]
    k_pool.index_copy_(0, ctx.out_kv_slots, k.to(k_pool.dtype))
    v_pool.index_copy_(0, ctx.out_kv_slots, v.to(v_pool.dtype))
    if layout.all_decode:
        table, lens = layout.decode_slot_table()
        plan = layout.decode_plan(k_pool.shape[1])
        return get_kernel("attention_decode")(q, k_pool, v_pool, table, lens, scale, plan)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    grouped = set()
    shared = get_kernel("attention_prefill_shared")
    for members, plen in layout.prefill_groups():
        reqs = [ctx.reqs[i] for i in members]
        spans = [(ctx.starts[i], ctx.extend_lens[i]) for i in members]
        outs = shared(
            [q[s : s + n] for s, n in spans],
            k_pool,
            v_pool,
            [r.kv_slots[: r.seq_len].to(device=q.device, dtype=torch.long) for r in reqs],
            [r.prefix_len for r in reqs],
            plen,
            scale,
        )
        for (s, n), o in zip(spans, outs):
            out[s : s + n] = o
        grouped.update(members)
    prefill = get_kernel("attention_prefill")
    for i in layout.prefill_reqs:
        if i in grouped:
            continue
        r = ctx.reqs[i]
        s, n = ctx.starts[i], ctx.extend_lens[i]
        slots = r.kv_slots[: r.seq_len].to(device=q.device, dtype=torch.long)
        out[s : s + n] = prefill(q[s : s + n], k_pool, v_pool, slots, r.prefix_len, scale)
    if layout.decode_reqs:
        table, lens = layout.decode_slot_table()
        rows = layout.decode_rows
        plan = layout.decode_plan(k_pool.shape[1])
        decode = get_kernel("attention_decode")
        out[rows] = decode(q[rows], k_pool, v_pool, table, lens, scale, plan)
    return out
