"""The per-forward layout: where every request's tokens, slots and snapshots are, built once
per forward by the runner (``ForwardLayout.build``) and read by every layer and kernel op.

Tokens of all requests are packed in request order (rows of every ``[T, ...]`` activation).
A forward splits its requests into *decodes* (one new token) and *prefills* (more); each part
has its own record, with the packed rows it owns, its working state slots and its snapshot
slots as tensors on the forward's device, so no layer builds an index or copies to the device::

    rows  0 .. Td-1        Td .. T-1          (decodes first when the scheduler orders them so)
          decode rows      prefill segments, varlen: cu_seqlens = [0, n_0, n_0+n_1, ...]
                           snapshot k: the state after snapshot_offsets[k] tokens of segment
                           snapshot_seqs[k], written into snapshot_slots[k]

Backends add their own per-forward tensors in ``KernelBackend.prepare`` (``meta``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mambaradix.core import ForwardReq


def _long(values: list[int], device: str | torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


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
    """The decodes of a forward: request ``reqs[i]`` has one new token at packed row
    ``rows.take(x)[i]``, working state slot ``state_slots[i]`` and (with attention) the KV slot
    row ``kv_table[i, :seq_lens[i]]`` (entries past it are any valid slot). A snapshot of a
    decode is its state after its one token: ``snapshot_rows`` (index into the decodes) ->
    ``snapshot_slots``."""

    reqs: list[int]
    rows: RowSet
    state_slots: torch.Tensor
    snapshot_rows: torch.Tensor
    snapshot_src: torch.Tensor  # state_slots[snapshot_rows]
    snapshot_slots: torch.Tensor
    seq_lens: torch.Tensor
    kv_table: torch.Tensor | None = None

    @property
    def num_snapshots(self) -> int:
        return self.snapshot_slots.numel()


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
        dec = [i for i, n in enumerate(extend_lens) if n == 1]
        pre = [i for i, n in enumerate(extend_lens) if n > 1]

        out: list[torch.Tensor] = []
        given = decode_table is not None and decode_table.shape[0] > 0
        first = decode_table.shape[0] if given else 0
        if given:  # the decodes' one new slot each, in one gather
            col = torch.tensor(prefix_lens[:first], dtype=torch.long, device=decode_table.device)
            out.append(decode_table.gather(1, col[:, None])[:, 0])
        out += [r.kv_slots[r.prefix_len : r.seq_len] for r in reqs[first:]]
        out_kv = (
            torch.cat(out).to(device=device, dtype=torch.long)
            if out
            else torch.empty(0, dtype=torch.long, device=device)
        )

        decode = None
        if dec:
            snap_rows, snap_src, snap_dst = [], [], []
            for k, i in enumerate(dec):
                for _, slot in reqs[i].snapshots:  # n can only be 1
                    snap_rows.append(k)
                    snap_src.append(reqs[i].state_slot)
                    snap_dst.append(slot)
            seq_lens = [reqs[i].seq_len for i in dec]
            table = None
            if with_kv:
                if given and first == len(dec) and dec == list(range(first)):
                    table = decode_table.to(device=device, dtype=torch.long)
                else:
                    table = torch.nn.utils.rnn.pad_sequence(
                        [reqs[i].kv_slots[: reqs[i].seq_len] for i in dec],
                        batch_first=True,
                        padding_value=0,
                    ).to(device=device, dtype=torch.long)
            decode = DecodeRows(
                reqs=dec,
                rows=RowSet.of([starts[i] for i in dec], total, device),
                state_slots=_long([reqs[i].state_slot for i in dec], device),
                snapshot_rows=_long(snap_rows, device),
                snapshot_src=_long(snap_src, device),
                snapshot_slots=_long(snap_dst, device),
                seq_lens=_long(seq_lens, device),
                kv_table=table,
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
                    reqs[i].kv_slots[: reqs[i].seq_len].to(device=device, dtype=torch.long)
                    for i in pre
                ]
                if with_kv
                else [],
                snapshot_seqs=seqs,
                snapshot_offsets=offs,
                snapshot_slots=_long(slots, device),
            )

        if prefill is None:
            logit_rows = None  # one row per request, all of them
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
