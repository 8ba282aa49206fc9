"""Planning of the cascade decode attention (``kernels.attention.attention_decode``).

A decode step's requests often start with the same KV slots: a prefix they share through the
radix cache. The plan groups them, so that attention reads each shared prefix once per group,
and records where each request's own keys begin. It depends only on the slot table, so a
forward computes it once for all its attention layers, and the next forward reuses it while it
still fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIN_SHARED = 32  # shorter common prefixes are not worth a separate pass


@dataclass(slots=True)
class SharedPiece:
    """Groups of decodes sharing a prefix of ``plen`` slots, attended in one call: group ``i``'s
    members (padded to ``width`` with copies of a member) stack their queries against its one
    prefix."""

    plen: int
    n: int  # groups
    width: int  # members per group, padded
    queries: torch.Tensor  # [n * width] request of each padded position
    kv_rows: torch.Tensor  # [n * Hkv * plen] rows of a pool viewed as [size * Hkv, D]


@dataclass(slots=True)
class DecodePlan:
    """The index work of ``attention_decode``: it depends only on the slot table, so a forward
    computes it once for all its attention layers (per layer it had been ~100 small ops).

    Request ``b``'s own keys are ``slot_table[b, begin[b]:seq_lens[b]]``; the keys before
    ``begin[b]`` are a shared piece's, whose output for ``b`` is row ``shared_row[b]`` of the
    pieces' stacked rows (-1: no shared piece)."""

    slot_table: torch.Tensor  # [B, L]
    seq_lens: torch.Tensor  # [B]
    num_kv_heads: int
    begin: torch.Tensor  # [B]
    pieces: list[SharedPiece]
    shared_row: torch.Tensor  # [B]
    shared_members: torch.Tensor  # [M] requests with a shared piece
    _own: tuple[int, torch.Tensor, torch.Tensor | None] | None = None

    def own_keys(self) -> tuple[int, torch.Tensor, torch.Tensor | None]:
        """``(span, rows, visible)`` for gathering every request's own keys at once: the
        longest own span, the pool rows (``[B * Hkv * span]`` of a pool viewed as
        ``[size * Hkv, D]``) and a ``[B, 1, 1, span]`` mask (None when every span is full)."""
        if self._own is None:
            n = self.seq_lens - self.begin  # every own span keeps >= 1 key
            span = int(n.max())
            pos = torch.arange(span)
            idx = (self.begin[:, None] + pos[None, :]).clamp_(max=self.slot_table.shape[1] - 1)
            visible = pos[None, :] < n[:, None]
            rows = pool_rows(self.slot_table.gather(1, idx), self.num_kv_heads)
            self._own = (span, rows, None if bool(visible.all()) else visible[:, None, None, :])
        return self._own


def decode_plan(
    slot_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_heads: int,
    groups: list[tuple[torch.Tensor, int]] | None = None,
    previous: DecodePlan | None = None,
) -> DecodePlan:
    """Plan ``attention_decode`` over ``slot_table`` [B, L] / ``seq_lens`` [B] for pools with
    ``num_kv_heads`` heads. ``groups`` (``shared_prefixes``) is computed when not given.

    ``previous``, the plan of the forward before, is reused (with the new table and lengths)
    when its pieces still hold: as many rows, the same slots in every row up to the longest
    shared prefix, and every request still past its prefix. That is the usual decode step
    after a decode step, and the check costs one compare instead of the grouping. (Rows that
    changed but kept their prefix slots are still served exactly: a piece only needs its
    members to start with its slots.)"""
    B = slot_table.shape[0]
    longest = int(seq_lens.max()) if B else 0
    if longest > slot_table.shape[1]:  # a kernel would read past the table
        raise ValueError(
            f"attention_decode: a seq_len of {longest} exceeds the slot table's "
            f"{slot_table.shape[1]} columns"
        )
    if previous is not None and _still_fits(previous, slot_table, seq_lens, num_kv_heads):
        return DecodePlan(
            slot_table,
            seq_lens,
            num_kv_heads,
            previous.begin,
            previous.pieces,
            previous.shared_row,
            previous.shared_members,
        )
    if groups is None:
        groups = shared_prefixes(slot_table, seq_lens)
    begin = torch.zeros(B, dtype=torch.long)
    shared_row = torch.full((B,), -1, dtype=torch.long)
    pieces = []
    by_len: dict[int, list[torch.Tensor]] = {}
    for members, plen in groups:
        begin[members] = plen
        by_len.setdefault(plen, []).append(members)
    first = 0  # a piece's first row among the stacked rows of all pieces
    for plen, mems in by_len.items():
        count, width = len(mems), max(len(mb) for mb in mems)
        padded = torch.stack([F.pad(mb, (0, width - len(mb)), value=int(mb[0])) for mb in mems])
        for i, mb in enumerate(mems):
            shared_row[mb] = torch.arange(len(mb)) + first + i * width
        first += count * width
        pieces.append(
            SharedPiece(
                plen=plen,
                n=count,
                width=width,
                queries=padded.reshape(-1),
                kv_rows=pool_rows(slot_table[padded[:, 0], :plen], num_kv_heads),
            )
        )
    members = torch.nonzero(shared_row >= 0).flatten()
    return DecodePlan(slot_table, seq_lens, num_kv_heads, begin, pieces, shared_row, members)


def _still_fits(
    plan: DecodePlan, slot_table: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int
) -> bool:
    old = plan.slot_table
    if plan.num_kv_heads != num_kv_heads or old.shape[0] != slot_table.shape[0]:
        return False
    # without pieces, the first slots: rows starting alike would now form a group
    longest = max((p.plen for p in plan.pieces), default=1)
    if slot_table.shape[1] < longest or old.device != slot_table.device:
        return False
    if not bool((seq_lens > plan.begin).all()):
        return False
    same = old[:, :longest] == slot_table[:, :longest]
    if bool(same.all()):
        return True
    # a short row's padding may have become slots: only each row's old length counts
    past = torch.arange(longest, device=old.device)[None, :] >= plan.seq_lens[:, None]
    return bool((same | past).all())


def pool_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of a pool viewed as ``[size * Hkv, D]`` that hold the K (or V) of ``slots`` [n, L],
    ordered so that gathering them gives ``[n, Hkv, L, D]`` (contiguous for the matmuls)."""
    heads = torch.arange(num_kv_heads)[None, :, None]
    return (slots[:, None, :] * num_kv_heads + heads).reshape(-1)


def shared_prefixes(
    slot_table: torch.Tensor, seq_lens: torch.Tensor
) -> list[tuple[torch.Tensor, int]]:
    """Groups of requests (member indices) whose rows share their first ``plen`` slots, with
    ``plen`` >= MIN_SHARED and below every member's length (each keeps >= 1 own key)."""
    n = slot_table.shape[0]
    if n < 2 or slot_table.shape[1] < MIN_SHARED:
        return []
    _, inverse, counts = torch.unique(slot_table[:, 0], return_inverse=True, return_counts=True)
    if int(counts.max()) < 2:
        return []
    leader = torch.zeros(counts.shape[0], dtype=torch.long).scatter_(0, inverse, torch.arange(n))
    same = (slot_table == slot_table[leader[inverse]]).to(torch.int32).cumprod(1).sum(1)
    per_row = torch.minimum(same, seq_lens - 1)
    plen = torch.full((counts.shape[0],), 1 << 62, dtype=torch.long)
    plen = plen.scatter_reduce(0, inverse, per_row, reduce="amin")
    groups = []
    for gi in torch.nonzero((counts > 1) & (plen >= MIN_SHARED)).flatten().tolist():
        groups.append((torch.nonzero(inverse == gi).flatten(), int(plen[gi])))
    return groups
