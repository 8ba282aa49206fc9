"""Snapshot strategies: where a request's recurrent-state snapshots land (design.md section 5).

Both strategies answer the same events; the scheduler calls them and never asks which one it
holds:

==================  ==========================================  ==========================
event               ``no_buffer`` (1 state slot per request)    ``extra_buffer`` (3 slots)
==================  ==========================================  ==========================
plan a forward      cut the forward at the snapshot (it is the  snapshot inside the forward
                    forward's end state)                        into a tracking slot
start of a batch    copy working -> a new slot (recorded the    nothing
                    batch before), for the tree
forward end         the copy ran: insert it into the tree       donate the tracking slot
                                                                to the tree (no copy)
finish              the working slot is donated at a page end   ... or the last page-
                                                                boundary tracking slot
abort, retraction   drop the snapshot plan                      drop the snapshot plan
==================  ==========================================  ==========================

One request's snapshot plan is one record, ``SnapshotPlan``, on ``Req.snapshot_plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mambaradix.cache.evict_policy import SPARE_PINNED, SPARE_SHARED
from mambaradix.cache.request_cache import RequestCache
from mambaradix.core import EXTRA_BUFFER, NO_BUFFER
from mambaradix.engine.planner import Segment, plan_forward, snapshot_alignment
from mambaradix.kernels.capabilities import BackendCapabilities
from mambaradix.stats import EngineStats

if TYPE_CHECKING:
    from mambaradix.cache.radix import TreeNode
    from mambaradix.core import StateOps
    from mambaradix.engine.request import Req


@dataclass(slots=True)
class SnapshotPlan:
    """Where one request will snapshot, and what it has written where."""

    wanted: list[int] = field(default_factory=list)  # snapshot positions it aims for, sorted
    share_targets: list[int] = field(default_factory=list)  # branch snapshots others wait for
    branches: set[int] = field(default_factory=set)  # wanted positions that are branch points
    copy_at: int | None = None  # no_buffer: position copied out of the working slot next batch
    track_next: int = 0  # extra_buffer: the tracking slot the next snapshot goes into
    page_track: tuple[int, int] | None = None  # (page-aligned position, track index) written
    track_epoch: int = 0  # bumped by every donated tracking snapshot (invalidates page_track)
    lcp_cache: dict[str, int] = field(default_factory=dict)  # waiting: prefix shared with rid

    def drop_planned(self) -> None:
        """The request ends: nothing more to snapshot (what was written stays, for
        ``RequestCache.finish``)."""
        self.wanted = []
        self.share_targets = []
        self.branches = set()
        self.copy_at = None

    def reset(self) -> None:
        """Retraction (after its cache entries are in the tree): start over. ``track_epoch``
        keeps counting and ``lcp_cache`` stays valid (the request's tokens only grow)."""
        self.drop_planned()
        self.track_next = 0
        self.page_track = None

    def add_share_target(self, position: int) -> None:
        """Another request waits for this one's state at ``position``."""
        self.share_targets.append(position)
        self.branches.add(position)
        if position not in self.wanted:
            self.wanted.append(position)
            self.wanted.sort()

    def drop_share_targets(self, upto: int) -> None:
        """The state at positions ``<= upto`` is in the tree (or will never be)."""
        if self.share_targets:
            self.share_targets = [t for t in self.share_targets if t > upto]


@dataclass(slots=True)
class SnapshotSpot:
    """What one scheduled forward of a request snapshots (filled by the strategy)."""

    snapshots: list[tuple[int, int]]  # ForwardReq.snapshots: (offset in forward, slot)
    track: tuple[int, int] | None = None  # extra_buffer: (position, track index) to donate
    page_track: tuple[int, int, int] | None = None  # (position, track index, track epoch)


class SnapshotStrategy:
    """The interface both strategies implement (see the module's table)."""

    name: str
    track_slots: int  # state slots per request beyond the working slot

    def __init__(
        self,
        cache: RequestCache,
        stats: EngineStats,
        capabilities: BackendCapabilities | None = None,
    ) -> None:
        self.cache = cache
        self.stats = stats
        self.capabilities = capabilities or BackendCapabilities()
        self.align = snapshot_alignment(cache.page_size)
        # called with (request, position, node) when a state others wait for is in the tree
        self.on_shared: Callable[[Req, int, TreeNode], None] | None = None

    def _landed(self, req: Req, pos: int, node: TreeNode | None) -> None:
        """The state of ``req`` at ``pos`` went into the tree (``node``; None: it did not)."""
        plan = req.snapshot_plan
        if node is None:
            return
        if pos in plan.branches:
            self.cache.tree.mark_branch(node)
        if pos in plan.share_targets and self.on_shared is not None:
            self.on_shared(req, pos, node)

    @property
    def repeat_align(self) -> int:
        """Granularity of the exact-repeat snapshot (``planner.admission_targets``)."""
        return self.align

    def plan_forward(self, start: int, chunk_end: int, seq_len: int, wanted: list[int]) -> Segment:
        return plan_forward(
            start, chunk_end, seq_len, wanted, self.align, self.name, self.capabilities
        )

    def start_batch(self, ops: StateOps) -> list[tuple[Req, int, int]]:
        """Deferred work of the previous batch recorded into this one's state ops; returns
        (request, position, slot) of the copies it records."""
        return []

    def copies_done(self, copies: list[tuple[Req, int, int]]) -> None:
        """The copies ``start_batch`` recorded have run."""

    def snapshot(self, req: Req, start: int, end: int, snap: int | None) -> SnapshotSpot:
        """Where the forward of tokens [start, end) writes the state at ``snap`` (None: no
        snapshot wanted)."""
        raise NotImplementedError

    def forward_done(self, req: Req, end: int, spot: SnapshotSpot) -> None:
        """A forward of ``req`` ending at ``end`` has run."""
        raise NotImplementedError

    def finish_track(self, req: Req) -> tuple[int, int] | None:
        """The tracking slot ``RequestCache.finish`` may donate when the request ends between
        pages."""
        return req.snapshot_plan.page_track

    def end(self, req: Req) -> None:
        """Finish, abort or failure: drop what the request planned."""
        req.snapshot_plan.drop_planned()

    def retract(self, req: Req) -> None:
        """The request's cache entries are in the tree and it waits again: start over."""
        self.end(req)
        req.snapshot_plan.reset()


class NoBuffer(SnapshotStrategy):
    """One state slot per request; a snapshot is the forward's end state, copied out of the
    working slot at the start of the next batch."""

    name = NO_BUFFER
    track_slots = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # requests with ``snapshot_plan.copy_at`` set, in recording order
        self._copies: list[Req] = []

    def start_batch(self, ops: StateOps) -> list[tuple[Req, int, int]]:
        copies = []
        for req in self._copies:
            pos, req.snapshot_plan.copy_at = req.snapshot_plan.copy_at, None
            slot = self.cache.alloc_snapshot_slot(req.rc, _spare(req, pos))
            if slot is not None:
                ops.add_copy(req.rc.state_slot, slot)
                copies.append((req, pos, slot))
                self.stats.snapshot_copies += 1
            else:  # skipped: nobody may wait for it
                req.snapshot_plan.drop_share_targets(pos)
        self._copies = []
        return copies

    def copies_done(self, copies: list[tuple[Req, int, int]]) -> None:
        for req, pos, slot in copies:
            if req.rc is not None and slot in req.rc.pending:
                self._landed(req, pos, self.cache.insert_snapshot(req.rc, req.tokens(), pos, slot))
                req.snapshot_plan.drop_share_targets(pos)

    def snapshot(self, req: Req, start: int, end: int, snap: int | None) -> SnapshotSpot:
        if snap is not None:
            if req.snapshot_plan.copy_at is None:
                self._copies.append(req)
            req.snapshot_plan.copy_at = snap
        return SnapshotSpot([])

    def forward_done(self, req: Req, end: int, spot: SnapshotSpot) -> None:
        # a target at the forward's end waits for its copy (next batch)
        req.snapshot_plan.drop_share_targets(end - 1)

    def end(self, req: Req) -> None:
        if req.snapshot_plan.copy_at is not None:
            self._copies.remove(req)
        super().end(req)


class ExtraBuffer(SnapshotStrategy):
    """Two tracking slots per request besides the working one; the forward writes the snapshot
    into one of them, which is then donated to the tree without a copy. With pages > 1 decodes
    keep the state at the last page boundary in a tracking slot, so a finish between pages
    still leaves a state close behind."""

    name = EXTRA_BUFFER
    track_slots = 2

    @property
    def repeat_align(self) -> int:
        # a tracking slot takes any position inside the last forward at no extra cost
        return self.cache.page_size

    def snapshot(self, req: Req, start: int, end: int, snap: int | None) -> SnapshotSpot:
        plan, rc = req.snapshot_plan, req.rc
        if snap is not None:
            idx = plan.track_next
            plan.track_next ^= 1
            plan.page_track = None  # that slot may be donated: nothing to fall back on
            plan.track_epoch += 1
            return SnapshotSpot([(snap - start, rc.track_slots[idx])], track=(snap, idx))
        page = self.cache.page_size
        if page > 1 and end - start == 1 and end % page == 0:
            # overwrite the next tracking slot with the state at this page boundary; it is
            # donated only if the request finishes before its next page
            idx = plan.track_next
            return SnapshotSpot([(1, rc.track_slots[idx])], page_track=(end, idx, plan.track_epoch))
        return SnapshotSpot([])

    def forward_done(self, req: Req, end: int, spot: SnapshotSpot) -> None:
        plan = req.snapshot_plan
        if spot.track is not None:
            pos, idx = spot.track
            node = self.cache.donate_track(req.rc, idx, req.tokens(), pos, _spare(req, pos))
            self._landed(req, pos, node)
        if spot.page_track is not None and spot.page_track[2] == plan.track_epoch:
            plan.page_track = spot.page_track[:2]  # still what that slot holds
        plan.drop_share_targets(end)


def _spare(req: Req, pos: int) -> int:
    """What a snapshot's slot may not be taken from: a branch point's may evict other branch
    points, any other snapshot only the states no request went on from in two ways."""
    return SPARE_PINNED if pos in req.snapshot_plan.branches else SPARE_SHARED


def make_strategy(
    cache: RequestCache, stats: EngineStats, capabilities: BackendCapabilities | None = None
) -> SnapshotStrategy:
    """The strategy object for ``cache.strategy``. Without the cache nothing is snapshot and a
    request holds one state slot whatever the strategy flag says: ``NoBuffer`` then never
    receives a snapshot position."""
    cls = NoBuffer if cache.strategy == NO_BUFFER or not cache.enabled else ExtraBuffer
    return cls(cache, stats, capabilities)
