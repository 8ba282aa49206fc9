"""Admission: waiting requests into the running set (design.md section 6).

Each candidate is matched against the tree right before it is admitted (an earlier admission
may have evicted nodes), may be held back for a running request about to snapshot a longer
shared prefix (``engine.sharing``), gets its snapshot targets (``planner.admission_targets``),
its cache resources (with the resume copy or clear) and its first prefill chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mambaradix.cache.evict_policy import SPARE_NOTHING, SPARE_PINNED
from mambaradix.cache.radix import MatchResult
from mambaradix.cache.request_cache import RequestCache
from mambaradix.engine.forwards import ForwardBuilder, ScheduledBatch
from mambaradix.engine.planner import admission_targets, branch_points
from mambaradix.engine.request import Req, ReqStatus
from mambaradix.engine.sharing import (
    held_for_sharing,
    match_limit,
    pin_loaded,
    shared_with_queue,
    unpin,
)
from mambaradix.engine.strategies import SnapshotStrategy
from mambaradix.stats import EngineStats


class Admission:
    def __init__(
        self,
        cache: RequestCache,
        strategy: SnapshotStrategy,
        builder: ForwardBuilder,
        stats: EngineStats,
        *,
        max_running: int,
        lpm: bool,
        fail: Callable[[Req, BaseException], None],
    ) -> None:
        self.cache = cache
        self.strategy = strategy
        self.builder = builder
        self.stats = stats
        self.max_running = max_running
        self.lpm = lpm  # --schedule-policy lpm: longest cached prefix first
        self.fail = fail
        self.s_per_token = 0.0  # measured forward seconds per computed token (0: unknown)

    def admit(
        self, batch: ScheduledBatch, budget: int, waiting: list[Req], running: list[Req]
    ) -> int:
        """Admit what fits into ``batch`` (moving requests from ``waiting`` to ``running``);
        returns the prefill budget left."""
        if not waiting:
            return budget
        if self.cache.storage is not None and self.cache.poll_loads():
            pin_loaded(self.cache.tree, waiting)
        order = waiting
        if self.lpm and self.cache.enabled:
            hits = {id(r): self.cache.match(r.tokens()).prefix_len for r in waiting}
            order = sorted(waiting, key=lambda r: -hits[id(r)])
        align = self.strategy.align
        for req in list(order):
            if len(running) >= self.max_running or budget <= 0:
                break
            if req.loading is not None and not req.loading.done:
                continue  # its prefix is being read from storage
            tokens = req.tokens()
            limit = match_limit(req)
            m = self.cache.match(tokens, limit)
            if self.cache.storage is not None and self._wait_for_storage(req, tokens, m, limit):
                continue
            if req.generator is None and req.params.seed is not None:
                try:
                    req.generator = torch.Generator().manual_seed(req.params.seed)
                except Exception as exc:  # a seed out of range that slipped through
                    self.fail(req, exc)
                    continue
            if limit is None:
                hold = held_for_sharing(req, m.prefix_len, running, align)
                if hold is not None:
                    if hold.new_target:
                        hold.req.snapshot_plan.add_share_target(hold.position)
                    self.stats.held_for_sharing += 1
                    continue
            queue_branch = (
                shared_with_queue(req, waiting, m.prefix_len, align) if self.cache.enabled else 0
            )
            branches = branch_points(len(tokens), m.prefix_len, m.kv_len, queue_branch, align)
            wanted = admission_targets(
                seq_len=len(tokens),
                prefix_len=m.prefix_len,
                kv_len=m.kv_len,
                queue_branch=queue_branch,
                align=align,
                repeat_align=self.strategy.repeat_align,
                branches=branches,
            )
            first_end = min(len(tokens), m.prefix_len + min(self.builder.chunk, budget))
            if self.cache.enabled:
                first_end = self.strategy.plan_forward(
                    m.prefix_len, first_end, len(tokens), wanted
                ).end
            # states pinned for waiting requests go only when nothing runs that could free
            # slots by finishing
            got = self.cache.admit(m, first_end, SPARE_PINNED if running else SPARE_NOTHING)
            if got is None:
                self.stats.admission_waits += 1
                break
            req.rc, ops = got
            unpin(self.cache.tree, req)
            self.stats.resumes += m.prefix_len > 0
            batch.state_ops.extend(ops)
            waiting.remove(req)
            running.append(req)
            req.status = ReqStatus.RUNNING
            req.fed_len = m.prefix_len
            req.snapshot_plan.share_targets = [queue_branch] if queue_branch > m.prefix_len else []
            req.snapshot_plan.wanted = wanted
            req.snapshot_plan.branches = branches
            if req.cached_tokens < 0:
                req.cached_tokens = m.prefix_len
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.cached_tokens += m.prefix_len
                if req.loading is not None and req.loading.ok:
                    req.storage_tokens = max(
                        0, min(m.prefix_len, req.loading.position) - req.ram_prefix
                    )
                    self.stats.storage_hit_tokens += req.storage_tokens
                if m.kv_len > m.prefix_len:  # KV matched past the last state it could use
                    self.stats.lost_reuse_requests += 1
                    self.stats.lost_reuse_tokens += m.kv_len - m.prefix_len
            req.loading = None
            if req.queue_time is None:
                req.queue_time = time.monotonic() - req.arrival
            taken = self.builder.add_prefill(batch, req, budget)
            batch.entries[-1].resumed = m.prefix_len > 0
            budget -= taken
        return budget

    def _wait_for_storage(
        self, req: Req, tokens: list[int], m: MatchResult, limit: int | None
    ) -> bool:
        """Ask the storage tier once per request for a deeper prefix than the RAM tree's;
        True when the request must wait for it to be loaded."""
        if req.storage_probed:
            return False
        req.storage_probed = True
        req.ram_prefix = m.prefix_len
        ticket = self.cache.start_load(tokens, m, limit, self.s_per_token)
        if ticket is None:
            return False
        req.loading = ticket
        return True
