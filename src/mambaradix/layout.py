"""The per-forward layout: where every request's tokens, slots and snapshots are, built once
per forward by the runner (``ForwardLayout.build``) and read by every layer and kernel op.

Tokens of all requests are packed in request order (rows of every ``[T, ...]`` activation).
A forward splits its requests into *decodes* and *prefills*; each part has its own record, with
the packed rows it owns, its working state slots and its snapshot slots as tensors on the
forward's device, so no layer builds an index or copies to the device::

    rows  0 .. Td-1        Td .. T-1          (decodes first when the scheduler orders them so)
          decode rows      prefill segments, varlen: cu_seqlens = [0, n_0, n_0+n_1, ...]
                           snapshot k: the state after snapshot_offsets[k] tokens of segment
                           snapshot_seqs[k], written into snapshot_slots[k]

A decode is a request of one new token, or a ``VerifyReq``: a speculative verify step's last
token and drafts (``engine.forwards.ForwardBuilder.add_verify``), a snapshot after each but
the last. The recurrent ops step through such a decode's positions as decode steps do, the
state after each position written into that position's snapshot slot (the working slot after
the last); its attention has one query row per position, causal (``DecodeRows``). A prefill
kernel built for long segments would instead cut the segment at every snapshot::

    verify of k drafts:  row   t0      t1      ...  tk        (t0: the last sampled token)
                         state slot_1  slot_2  ...  working   (slot_n: the snapshot (n, slot))
                         keys  ..p+1   ..p+2   ...  ..p+k+1   (p: its prefix length)

Backends add their own per-forward tensors in ``KernelBackend.prepare`` (``meta``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from mambaradix.core import ForwardReq


def to_device(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``. To a CUDA device the copy is queued from pinned memory
    without waiting: a blocking host-to-device copy waits for every kernel queued before it,
    so building the next forward's layout would wait for the forward in flight (overlap:
    ``engine.runner``). The caching host allocator keeps the pinned block until its copy ran."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _long(values: list[int], device: str | torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.long), device)


@dataclass(slots=True)
class VerifyReq(ForwardReq):
    """A speculative verify step's part of a forward: the request's last sampled token and its
    draft tokens, with a snapshot ``(n, slot)`` after each of them but the last (the state to
    keep if the draft is accepted up to there). Laid out as a decode of several positions
    (``DecodeRows``), not a prefill segment."""


@dataclass(slots=True)
class RowSet:
    """Rows of the packed batch owned by one part of the forward: all of them (``whole``), one
    contiguous range (``span``) or an index tensor (``index``)."""

    count: int
    whole: bool
    span: tuple[int, int] | None
    index: torch.Tensor

    @classmethod
    def of(cls, rows: list[int], total: int, device: str | torch.device) -> RowSet:
        contiguous = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))
        span = (rows[0], rows[0] + len(rows)) if contiguous else None
        return cls(len(rows), span == (0, total), span, _long(rows, device))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``x[rows]`` (a view where the rows are contiguous)."""
        if self.whole:
            return x
        if self.span is not None:
            return x[self.span[0] : self.span[1]]
        return x.index_select(0, self.index)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write ``values`` into ``out``'s rows; returns ``out`` (``values`` itself when the
        rows are the whole batch)."""
        if self.whole:
            return values.to(out.dtype) if values.dtype != out.dtype else values
        if self.span is not None:
            out[self.span[0] : self.span[1]] = values
        else:
            out.index_copy_(0, self.index, values.to(out.dtype))
        return out


@dataclass(slots=True)
class DecodeRows:
    """The decodes of a forward: request ``reqs[i]`` has ``widths[i]`` new tokens (1, or a few
    that each snapshot: a verify step), consecutive rows of ``rows.take(x)`` (``cu`` [D+1]:
    where each request's rows begin; ``Td`` is the number of rows). Its state is read from its
    working slot ``state_slots[i]``; the state after row ``r`` is written into
    ``row_slots[r]``: the snapshot slot of that position, the working slot after a request's
    last row (``cu`` and ``row_slots`` are None when every decode has one position: the state
    after it goes back into the working slot). Row ``r`` attends ``kv_table[r, :seq_lens[r]]``
    (its request's KV slots up to its own token: causal among a request's rows; entries past
    it are any valid slot). Snapshots that no row writes (the state after a request's last
    row, a second slot at one position) are copies after the op: ``snapshot_src`` (the slot
    holding that state then) -> ``snapshot_slots``; ``snapshot_rows`` are their rows among the
    decode rows."""

    reqs: list[int]
    rows: RowSet
    state_slots: torch.Tensor
    snapshot_rows: torch.Tensor
    snapshot_src: torch.Tensor
    snapshot_slots: torch.Tensor
    seq_lens: torch.Tensor
    kv_table: torch.Tensor | None = None
    widths: list[int] = field(default_factory=list)
    cu: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None
    written: int = 0  # snapshots written at their rows (row_slots)
    positions: list[DecodePosition] | None = field(default=None, repr=False)

    @property
    def num_snapshots(self) -> int:
        """Every snapshot of the decodes: those written at their rows and the copies."""
        return self.written + self.snapshot_slots.numel()

    @property
    def num_copies(self) -> int:
        return self.snapshot_slots.numel()

    @property
    def multi(self) -> bool:
        """Whether a decode has several positions."""
        return self.cu is not None


@dataclass(slots=True)
class DecodePosition:
    """Position ``j`` of every decode with more than ``j`` positions, as a forward of
    one-position decodes (``layout``) whose states are in place in the slots this position
    writes: ``rows`` are its rows among the decode rows; before its step, the states it starts
    from are copied into those slots (``copy_src`` -> ``copy_dst``: the working slot's state
    for position 0, the previous position's slot's after it). What a backend without a
    multi-position kernel runs, position after position (``decode_positions``)."""

    rows: RowSet
    copy_src: torch.Tensor
    copy_dst: torch.Tensor
    layout: ForwardLayout


@dataclass(slots=True)
class PrefillSegments:
    """The prefills of a forward as varlen segments (the shape GPU libraries take): segment
    ``p`` is request ``reqs[p]``, ``lens[p]`` new tokens after ``prefix_lens[p]`` cached ones,
    rows ``cu_seqlens[p] : cu_seqlens[p+1]`` of ``rows.take(x)``, state from and to
    ``state_slots[p]``; KV slots ``kv_slots[p]`` for every token 0 .. prefix_len + len."""

    reqs: list[int]
    lens: list[int]
    prefix_lens: list[int]
    cu_list: list[int]
    cu_seqlens: torch.Tensor
    rows: RowSet
    state_slots: torch.Tensor
    kv_slots: list[torch.Tensor]
    snapshot_seqs: list[int]
    snapshot_offsets: list[int]
    snapshot_slots: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.cu_list[-1]

    @property
    def num_snapshots(self) -> int:
        return len(self.snapshot_seqs)

    def snapshot_offsets_of(self, p: int) -> list[int]:
        return [n for s, n in zip(self.snapshot_seqs, self.snapshot_offsets) if s == p]


@dataclass(slots=True)
class ForwardLayout:
    """Everything a forward's layers need to know about its batch, built once.

    ``logit_rows``: the rows the model returns logits for (each request's last new token, or
    all its new tokens where ``ForwardReq.all_logits`` is set); None: every row, in order.
    ``meta``: the backend's own tensors (``KernelBackend.prepare``); ``carry``: the runner's
    dict kept from one forward to the next (a backend may reuse a plan there).
    """

    reqs: list[ForwardReq]
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_kv_slots: torch.Tensor
    starts: list[int]
    extend_lens: list[int]
    prefix_lens: list[int]
    logit_rows: torch.Tensor | None
    decode: DecodeRows | None
    prefill: PrefillSegments | None
    device: torch.device
    meta: object = None
    carry: dict | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        reqs: list[ForwardReq],
        device: str | torch.device = "cpu",
        decode_table: torch.Tensor | None = None,
        with_kv: bool = True,
        carry: dict | None = None,
    ) -> ForwardLayout:
        """``decode_table``: optional ``[D, L]`` KV slot rows of the first D requests, all
        decodes, gathered by the scheduler in one go. ``with_kv``: the model has attention
        layers (else no KV slot table is built)."""
        device = torch.device(device)
        prefix_lens = [r.prefix_len for r in reqs]
        extend_lens = [r.extend_len for r in reqs]
        starts, pos = [], 0
        for n in extend_lens:
            starts.append(pos)
            pos += n
        total = pos
        ids = [t for r in reqs for t in r.input_ids]
        positions = [p for r in reqs for p in range(r.prefix_len, r.seq_len)]
        is_decode = [r.extend_len == 1 or _positions(r) for r in reqs]
        dec = [i for i, d in enumerate(is_decode) if d]
        pre = [i for i, d in enumerate(is_decode) if not d]

        out: list[torch.Tensor] = []
        given = decode_table is not None and decode_table.shape[0] > 0
        first = decode_table.shape[0] if given else 0
        if given:  # the decodes' one new slot each, in one gather
            col = torch.tensor(prefix_lens[:first], dtype=torch.long, device=decode_table.device)
            out.append(decode_table.gather(1, col[:, None])[:, 0])
        out += [r.kv_slots[r.prefix_len : r.seq_len] for r in reqs[first:]]
        out_kv = (
            to_device(torch.cat(out).to(torch.long), device)
            if out
            else torch.empty(0, dtype=torch.long, device=device)
        )

        decode = None
        if dec:
            widths = [extend_lens[i] for i in dec]
            multi = any(w > 1 for w in widths)
            snap_rows, snap_src, snap_dst, row_slots = [], [], [], []
            written = 0
            for i, w in zip(dec, widths):
                r, row0 = reqs[i], len(row_slots)
                at_row: dict[int, int] = {}  # position -> the slot its row writes
                for n, slot in r.snapshots:
                    if n < w and n not in at_row:
                        at_row[n] = slot
                        written += 1
                        continue
                    snap_rows.append(row0 + n - 1)
                    snap_src.append(at_row[n] if n < w else r.state_slot)
                    snap_dst.append(slot)
                row_slots += [at_row[n] for n in range(1, w)] + [r.state_slot]
            # each row's keys: its request's up to its own token
            seq_lens = [prefix_lens[i] + j for i, w in zip(dec, widths) for j in range(1, w + 1)]
            table = None
            if with_kv:
                if given and first == len(dec) and dec == list(range(first)):
                    table = to_device(decode_table.to(torch.long), device)
                else:
                    table = torch.nn.utils.rnn.pad_sequence(
                        [reqs[i].kv_slots[: reqs[i].seq_len] for i in dec],
                        batch_first=True,
                        padding_value=0,
                    )
                    table = to_device(table.to(torch.long), device)
                if multi:  # one row of the table per position
                    per_row = [k for k, w in enumerate(widths) for _ in range(w)]
                    table = table.index_select(0, _long(per_row, device))
            cu = [0]
            for w in widths:
                cu.append(cu[-1] + w)
            decode = DecodeRows(
                reqs=dec,
                rows=RowSet.of(
                    [s for i in dec for s in range(starts[i], starts[i] + extend_lens[i])],
                    total,
                    device,
                ),
                state_slots=_long([reqs[i].state_slot for i in dec], device),
                snapshot_rows=_long(snap_rows, device),
                snapshot_src=_long(snap_src, device),
                snapshot_slots=_long(snap_dst, device),
                seq_lens=_long(seq_lens, device),
                kv_table=table,
                widths=widths,
                cu=_long(cu, device) if multi else None,
                row_slots=_long(row_slots, device) if multi else None,
                written=written,
            )

        prefill = None
        if pre:
            lens = [extend_lens[i] for i in pre]
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            rows = [r for i in pre for r in range(starts[i], starts[i] + extend_lens[i])]
            seqs, offs, slots = [], [], []
            for p, i in enumerate(pre):
                for n, slot in reqs[i].snapshots:
                    seqs.append(p)
                    offs.append(n)
                    slots.append(slot)
            prefill = PrefillSegments(
                reqs=pre,
                lens=lens,
                prefix_lens=[prefix_lens[i] for i in pre],
                cu_list=cu,
                cu_seqlens=_long(cu, device),
                rows=RowSet.of(rows, total, device),
                state_slots=_long([reqs[i].state_slot for i in pre], device),
                kv_slots=[
                    to_device(reqs[i].kv_slots[: reqs[i].seq_len].to(torch.long), device)
                    for i in pre
                ]
                if with_kv
                else [],
                snapshot_seqs=seqs,
                snapshot_offsets=offs,
                snapshot_slots=_long(slots, device),
            )

        if all(r.extend_len == 1 or r.all_logits for r in reqs):
            logit_rows = None  # every row: one per request, or all of a request's
        elif any(r.all_logits for r in reqs):
            picked: list[int] = []
            for r, s, n in zip(reqs, starts, extend_lens):
                picked.extend(range(s, s + n) if r.all_logits else (s + n - 1,))
            logit_rows = _long(picked, device)
        else:
            logit_rows = _long([s + n - 1 for s, n in zip(starts, extend_lens)], device)

        return cls(
            reqs=reqs,
            input_ids=_long(ids, device),
            positions=_long(positions, device),
            out_kv_slots=out_kv,
            starts=starts,
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            logit_rows=logit_rows,
            decode=decode,
            prefill=prefill,
            device=device,
            carry=carry,
        )


def _positions(r: ForwardReq) -> bool:
    """Whether ``r`` is a decode of several positions (a ``VerifyReq``); raises ValueError for
    one that lacks the slot of a position's state."""
    if not isinstance(r, VerifyReq):
        return False
    at = {n for n, _ in r.snapshots}
    missing = [n for n in range(1, r.extend_len) if n not in at]
    if missing:
        raise ValueError(
            f"a verify request of {r.extend_len} tokens has no snapshot slot for the state after "
            f"token(s) {missing}: it needs one after each of its tokens but the last"
        )
    return True


def decode_positions(layout: ForwardLayout) -> list[DecodePosition]:
    """The decodes of ``layout`` position by position (built once per forward, kept in
    ``layout.decode.positions``): what a backend runs its one-position decode step over, in
    order, for decodes of several positions."""
    dec = layout.decode
    if dec.positions is not None:
        return dec.positions
    device = dec.state_slots.device
    slots = dec.state_slots.tolist()
    row_slots = dec.row_slots.tolist() if dec.row_slots is not None else slots
    cu = dec.cu.tolist() if dec.cu is not None else list(range(len(slots) + 1))
    positions = []
    for j in range(max(dec.widths, default=1)):
        members = [k for k, w in enumerate(dec.widths) if w > j]
        rows = [cu[k] + j for k in members]
        src = [slots[k] if j == 0 else row_slots[cu[k] + j - 1] for k in members]
        dst = [row_slots[r] for r in rows]
        moved = [(a, b) for a, b in zip(src, dst) if a != b]
        one = DecodeRows(
            reqs=[dec.reqs[k] for k in members],
            rows=RowSet.of(list(range(len(rows))), len(rows), device),
            state_slots=_long(dst, device),
            snapshot_rows=_long([], device),
            snapshot_src=_long([], device),
            snapshot_slots=_long([], device),
            seq_lens=dec.seq_lens[rows],
            kv_table=None if dec.kv_table is None else dec.kv_table[rows],
            widths=[1] * len(rows),
        )
        positions.append(
            DecodePosition(
                rows=RowSet.of(rows, dec.rows.count, device),
                copy_src=_long([a for a, _ in moved], device),
                copy_dst=_long([b for _, b in moved], device),
                layout=dataclasses.replace(
                    layout, decode=one, prefill=None, logit_rows=None, meta=None, carry=None
                ),
            )
        )
    dec.positions = positions
    return positions


@dataclass(slots=True)
class ForwardContext:
    """What a model's forward reads: the layout, and the pools the layers read and write
    (``kv_pool.k[i]`` / ``.v[i]`` of attention layer i, ``state_pool.conv[j]`` /
    ``.temporal[j]`` of recurrent layer j)."""

    layout: ForwardLayout
    kv_pool: object  # cache.kv_pool.KVPool (duck-typed)
    state_pool: object  # cache.state_pool.StatePool (duck-typed)

    @classmethod
    def build(
        cls,
        reqs: list[ForwardReq],
        kv_pool: object,
        state_pool: object,
        device: str | torch.device = "cpu",
        decode_table: torch.Tensor | None = None,
        carry: dict | None = None,
    ) -> ForwardContext:
        """A context over a fresh layout (the model's backend prepares it on first use)."""
        with_kv = kv_pool is None or bool(getattr(kv_pool, "k", None))
        layout = ForwardLayout.build(reqs, device, decode_table, with_kv=with_kv, carry=carry)
        return cls(layout, kv_pool, state_pool)
