"""The running set: its decodes and continuing prompt chunks in each batch, and retraction
when the KV pool cannot hold its next tokens.

A retracted request gives what it computed to the tree (``RequestCache.finish``), goes back to
the front of the queue and later resumes from its own snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mambaradix.cache.evict_policy import SPARE_PINNED
from mambaradix.cache.request_cache import RequestCache
from mambaradix.engine.forwards import ForwardBuilder, ScheduledBatch
from mambaradix.engine.request import Req, ReqStatus
from mambaradix.engine.speculative import Speculation
from mambaradix.engine.strategies import SnapshotStrategy
from mambaradix.stats import EngineStats

logger = logging.getLogger(__name__)


class RunningSet:
    """``settle()`` processes the batch in flight and releases finished requests (retraction
    needs every result in: the runner may not hold a batch of the victim)."""

    def __init__(
        self,
        cache: RequestCache,
        strategy: SnapshotStrategy,
        builder: ForwardBuilder,
        stats: EngineStats,
        *,
        context_length: int,
        settle: Callable[[], None],
        speculation: Speculation | None = None,
    ) -> None:
        self.cache = cache
        self.strategy = strategy
        self.builder = builder
        self.stats = stats
        self.context_length = context_length
        self.settle = settle
        self.speculation = speculation

    def schedule(self, batch: ScheduledBatch, running: list[Req], budget: int) -> int:
        """One decode per decoding request (first in the batch: one KV allocation and one
        slot-row gather for all), then the next chunk of those still in prefill; returns the
        prefill budget left."""
        decodes = [r for r in running if r.seq_len - r.fed_len == 1 and self._schedulable(r)]
        spec = self.speculation
        verifies = self._drafts(decodes) if spec and spec.drafts_for(len(decodes)) else []
        if verifies:
            drafted = {id(r) for r, _ in verifies}
            decodes = [r for r in decodes if id(r) not in drafted]
        if decodes:
            got = self.cache.ensure_kv_many(
                [r.rc for r in decodes], [r.fed_len + 1 for r in decodes]
            )
            decodes = [r for r, ok in zip(decodes, got) if ok]
        if decodes:
            rows = self.cache.kv_slots_many(
                [r.rc for r in decodes], max(r.fed_len + 1 for r in decodes)
            )
            for b, req in enumerate(decodes):
                self.builder.add(batch, req, req.fed_len + 1, kv_slots=rows[b, : req.fed_len + 1])
                budget -= 1
            batch.run.forward.decode_table = rows
        for req, draft in verifies:  # after the plain decodes (the decode table's rows)
            self.builder.add_verify(batch, req, draft)
            budget -= 1 + len(draft)
        if spec and spec.adaptive is not None:  # the policy times steps of this shape
            n = len(decodes) + len(verifies)
            batch.decode_rows = (n, n + sum(len(d) for _, d in verifies))
        for req in running:
            if req.seq_len - req.fed_len > 1 and budget > 0:
                budget -= self.builder.add_prefill(batch, req, budget)
        return budget

    def _drafts(self, decodes: list[Req]) -> list[tuple[Req, list[int]]]:
        """The decodes that verify a draft this step (cut to the adaptive cap where one is
        chosen), with their KV and scratch state slots taken; the others decode one token."""
        spec = self.speculation
        offers = [(req, draft) for req in decodes if (draft := spec.draft(req))]
        if spec.adaptive is not None and offers:
            cap = spec.adaptive.choose(
                [r for r, _ in offers], [len(d) for _, d in offers], len(decodes)
            )
            offers = [(r, d[:cap]) for r, d in offers if cap]
        out = []
        for req, draft in offers:
            rc = req.rc
            # (a draft's KV is optional: it never takes a waiting request's pinned prefix)
            if self.cache.ensure_kv(rc, req.fed_len + 1 + len(draft), SPARE_PINNED) and (
                self.cache.alloc_spec_slots(rc, len(draft))
            ):
                out.append((req, draft))
        return out

    def _schedulable(self, req: Req) -> bool:
        """A decode whose token would be past max_new_tokens or the context is not run."""
        return req.num_outputs() < req.params.max_new_tokens and req.seq_len < self.context_length

    def make_room_for_decodes(self, running: list[Req], waiting: list[Req]) -> None:
        """Retract the newest requests until every decode can get its next KV slot."""
        while True:
            page = self.cache.page_size
            need = sum(
                page
                for r in running
                if r.seq_len - r.fed_len == 1 and r.rc.kv_alloc < r.fed_len + 1
            )
            tree = self.cache.tree
            avail = self.cache.kv_pool.available() + (tree.evictable_kv() if tree else 0)
            if need <= avail or not running:
                return
            self.settle()
            if not running:
                return
            self.retract_newest(running, waiting)

    def retract_newest(self, running: list[Req], waiting: list[Req]) -> None:
        self.settle()
        if not running:
            return
        victim = running.pop()
        fed = victim.fed_len
        track = self.strategy.finish_track(victim)
        self.cache.finish(victim.rc, victim.tokens(), victim.fed_len, track)
        self.strategy.retract(victim)
        victim.rc = None
        victim.fed_len = 0
        victim.status = ReqStatus.WAITING
        waiting.insert(0, victim)
        self.stats.retractions += 1
        logger.debug("retracted %s at %d tokens", victim.rid, fed)
