"""Building one batch: a request's next forward (tokens, KV slots, snapshots, sampling, prompt
logprobs) appended to the ``RunBatch`` the scheduler hands the runner, and the ``Entry`` that
says what to do with it when the results arrive.

A request's sequence, as the scheduler sees it while building a batch::

    |<-- fed: scheduled in earlier batches -->|<-- this forward -->|<-- later -->|
    0                                       start                 end        seq_len
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mambaradix.cache.request_cache import RequestCache
from mambaradix.core import ForwardBatch, ForwardReq, StateOps
from mambaradix.engine.batch import RunBatch
from mambaradix.engine.request import Req
from mambaradix.engine.strategies import SnapshotSpot, SnapshotStrategy
from mambaradix.layout import VerifyReq
from mambaradix.stats import EngineStats


@dataclass(slots=True)
class Entry:
    """What to do with one request when its batch's results arrive."""

    req: Req
    end: int
    spot: SnapshotSpot
    sample_row: int | None = None
    resumed: bool = False
    prompt_idx: int | None = None  # its entry in RunBatch.prompt_rows (prompt logprobs)
    prompt_first: int = 0  # the prompt position of that entry's first target token
    draft: list[int] | None = None  # the draft tokens this forward verifies (speculation)


@dataclass(slots=True)
class ScheduledBatch:
    """A batch the scheduler is building: what the runner runs (``run``) and, per request,
    what to do with its results (``entries``, ``copies``)."""

    run: RunBatch
    entries: list[Entry]
    copies: list[tuple[Req, int, int]] = field(default_factory=list)  # no_buffer (req, pos, slot)
    # (decoding requests, rows they compute: one each plus the drafts verified), set with
    # --speculative-adaptive: a step of those alone times what such a shape costs
    decode_rows: tuple[int, int] | None = None

    @staticmethod
    def new(batch_id: int) -> ScheduledBatch:
        return ScheduledBatch(RunBatch(batch_id, ForwardBatch([], StateOps())), [])

    @property
    def state_ops(self) -> StateOps:
        return self.run.forward.state_ops


class ForwardBuilder:
    """Appends requests' forwards to a batch; the strategy says where snapshots land."""

    def __init__(
        self,
        cache: RequestCache,
        strategy: SnapshotStrategy,
        stats: EngineStats,
        *,
        chunk: int,
        track_interval: int,
    ) -> None:
        self.cache = cache
        self.strategy = strategy
        self.stats = stats
        self.chunk = chunk if chunk > 0 else 1 << 62
        self.track_interval = track_interval

    def add_prefill(self, batch: ScheduledBatch, req: Req, budget: int) -> int:
        """Schedule the request's next prompt chunk; returns the tokens it takes (0: none)."""
        start = req.fed_len
        chunk_end = min(req.seq_len, start + self.chunk, start + budget)
        if not self.cache.enabled:
            seg_end, snap = chunk_end, None
        else:
            floor = max(start, req.rc.tree_len)
            wanted = [w for w in req.snapshot_plan.wanted if w > floor]
            seg = self.strategy.plan_forward(start, chunk_end, req.seq_len, wanted)
            seg_end, snap = seg.end, seg.snapshot
        if not self.cache.ensure_kv(req.rc, seg_end):
            return 0
        self.add(batch, req, seg_end, snap)
        return seg_end - start

    def add(
        self,
        batch: ScheduledBatch,
        req: Req,
        end: int,
        snap: int | None = None,
        kv_slots: torch.Tensor | None = None,
    ) -> None:
        """Append the forward of tokens [fed_len, end) of ``req``, snapshotting ``snap``."""
        start = req.fed_len
        ids = req.token_slice(start, end)  # may hold placeholders of tokens still in flight
        if snap is None and self.cache.enabled and end - start == 1:
            # a decode snapshots every --mamba-track-interval tokens, at whole pages
            if end % self.track_interval == 0 and end % self.cache.page_size == 0:
                snap = end
        entry = Entry(req, end, self.strategy.snapshot(req, start, end, snap))
        run = batch.run
        if end == req.seq_len:
            entry.sample_row = len(run.sample_rows)
            run.sample_rows.append(len(run.forward.reqs))
            run.params.append(req.params)
            run.generators.append(req.generator)
            run.logit_states.append(req.logits_state)
            run.grammars.append(req.grammar)
        all_logits = False
        if req.params.wants_prompt_logprobs and start < len(req.prompt_ids):
            all_logits = self._add_prompt_logprobs(batch, entry, req, start, end)
        if start < len(req.prompt_ids) or end - start > 1:
            self.stats.computed_prefill_tokens += end - start
        run.forward.reqs.append(
            ForwardReq(
                prefix_len=start,
                input_ids=ids,
                kv_slots=self.cache.kv_slots(req.rc, end) if kv_slots is None else kv_slots,
                state_slot=req.rc.state_slot,
                snapshots=entry.spot.snapshots,
                all_logits=all_logits,
            )
        )
        batch.entries.append(entry)
        req.fed_len = end

    def add_verify(self, batch: ScheduledBatch, req: Req, draft: list[int]) -> None:
        """Append a verify forward: the request's last token and ``draft`` in one forward, the
        state after each token written into its scratch slots (``rc.spec_slots``, one per
        draft token: after the last one it is the working slot's), logits for every row. It is
        a ``VerifyReq``: the layout makes it a decode of several positions (the decode kernels
        step through them; a step graph replays it). The caller made sure no snapshot of the
        cache falls inside it (``Speculation.draft``)."""
        start = req.fed_len
        end = start + 1 + len(draft)
        run = batch.run
        entry = Entry(req, end, SnapshotSpot([]), draft=draft)
        entry.sample_row = len(run.sample_rows)
        run.drafts[entry.sample_row] = draft
        run.sample_rows.append(len(run.forward.reqs))
        run.params.append(req.params)
        run.generators.append(req.generator)
        run.logit_states.append(req.logits_state)
        run.grammars.append(req.grammar)
        run.forward.reqs.append(
            VerifyReq(
                prefix_len=start,
                input_ids=req.token_slice(start, start + 1) + draft,
                kv_slots=self.cache.kv_slots(req.rc, end),
                state_slot=req.rc.state_slot,
                snapshots=[(n + 1, slot) for n, slot in enumerate(req.rc.spec_slots)],
                all_logits=True,
            )
        )
        batch.entries.append(entry)
        req.fed_len = end  # until the results say how many were kept
        self.stats.spec_verify_ct += 1

    def _add_prompt_logprobs(
        self, batch: ScheduledBatch, entry: Entry, req: Req, start: int, end: int
    ) -> bool:
        """Ask the runner for the logprobs of the prompt tokens this segment predicts (row p
        predicts token p + 1) that the request still lacks; True if there are any."""
        first_wanted = req.params.prompt_logprob_start
        first = max(first_wanted + len(req.prompt_lps), start + 1)
        last = min(end, len(req.prompt_ids) - 1)
        if first > last:
            return False
        entry.prompt_idx, entry.prompt_first = len(batch.run.prompt_rows), first
        targets = req.prompt_ids[first : last + 1]
        index = len(batch.run.forward.reqs)
        top_k = req.params.prompt_top_logprobs
        batch.run.prompt_rows.append((index, first - 1 - start, targets, top_k))
        return True
