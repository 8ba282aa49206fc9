"""Request-level cache operations: admit, grow, snapshot, finish, release; both strategies.

A request's KV row in the request table::

    |<-- tree_len: tree-owned, kv-locked via `node` -->|<-- request-owned (pages) -->|
    0                                             tree_len                       kv_alloc

State slots a request holds: its working slot, under ``extra_buffer`` two tracking slots, and
under ``no_buffer`` the snapshot slots whose deferred copy is recorded but not yet inserted.
Nothing here touches state tensors: resumes and snapshot copies come back as ``StateOps``.
With the cache disabled the same interface allocates and frees, and the tree is absent.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_any
from dataclasses import dataclass, field

import torch

from mambaradix.cache.evict_policy import SPARE_NOTHING, SPARE_PINNED, SPARE_SHARED
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.radix import IntegrityError, MatchResult, RadixTree, TreeNode
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.state_pool import StatePool
from mambaradix.cache.storage.tier import (
    WRITE_BACK,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    LoadJob,
    StorageTier,
)
from mambaradix.core import EXTRA_BUFFER, STRATEGIES, StateOps, state_slots_per_request
from mambaradix.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class ReqCache:
    """Cache-side resources of one live request."""

    row: int
    state_slot: int
    track_slots: list[int]
    node: TreeNode | None  # kv-locked node at depth tree_len (None: cache disabled)
    tree_len: int = 0
    kv_alloc: int = 0
    state_node: TreeNode | None = None  # state-locked until the resume copy has run
    pending: list[int] = field(default_factory=list)  # no_buffer snapshot slots not yet inserted
    spec_slots: list[int] = field(default_factory=list)  # a verify step's states after each draft


@dataclass(slots=True, eq=False)
class LoadTicket:
    """A stored prefix being read into the pools for a waiting request::

        |<-- node: in the tree, kv-locked -->|<-- job.kv_slots: being read -->| state slot
        0                               ram_depth                         position

    ``done`` once the scheduler has collected it (``poll_loads``); ``ok``: the prefix is in the
    tree now (else the request recomputes), ``landed`` the node holding its state (the waiting
    requests pin it: ``sharing.pin_loaded``). Requests waiting for the same stored state share
    one ticket."""

    tokens: list[int]  # tokens [0, position)
    node: TreeNode
    job: LoadJob
    done: bool = False
    ok: bool = False
    landed: TreeNode | None = None

    @property
    def position(self) -> int:
        return self.job.prefix.position


class RequestCache:
    """What the scheduler calls; owns the tree and the pools' bookkeeping per request.

    Contract: every method either completes or leaves nothing allocated (admission and growth
    return None / False on shortage after trying eviction). ``check_integrity`` accounts for
    every KV and state slot: free, in the tree, or held by a live ``ReqCache``.
    """

    def __init__(
        self,
        kv_pool: KVPool,
        state_pool: StatePool,
        req_slots: ReqSlots,
        *,
        enabled: bool = True,
        strategy: str = EXTRA_BUFFER,
        stats: EngineStats | None = None,
        storage: StorageTier | None = None,
        state_policy: str = "lru",
    ) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown mamba scheduler strategy {strategy!r}")
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.req_slots = req_slots
        self.page_size = kv_pool.page_size
        self.strategy = strategy
        self.tree = (
            RadixTree(kv_pool, state_pool, page_size=self.page_size, state_policy=state_policy)
            if enabled
            else None
        )
        self.live: set[ReqCache] = set()
        self.stats = stats if stats is not None else EngineStats()  # counts into the engine's
        self.storage = storage if self.tree is not None else None
        self.loading: dict[str, LoadTicket] = {}  # by state key: loads not yet collected
        # pool writes of collected loads, for the runner to run before the next forward reads
        # (the tree already holds their nodes; nothing may read those slots before)
        self.pending_writes: list = []
        if self.storage is not None:
            self.tree.on_evict = self._demote

    @property
    def enabled(self) -> bool:
        return self.tree is not None

    @property
    def state_slots_per_req(self) -> int:
        return state_slots_per_request(self.strategy, self.enabled)

    # ------------------------------------------------------------------ lookup and admission

    def match(self, tokens: list[int], limit: int | None = None) -> MatchResult:
        """Lookup with limit len(tokens) - 1 (at least one token must be computed), or the
        smaller ``limit`` (a request that needs the logits of earlier positions)."""
        if self.tree is None:
            return MatchResult(0, 0, None, torch.empty(0, dtype=torch.long))  # type: ignore[arg-type]
        cap = len(tokens) - 1 if limit is None else min(limit, len(tokens) - 1)
        return self.tree.match(tokens, limit=cap)

    def admit(
        self, match: MatchResult, first_len: int, spare: int = SPARE_NOTHING
    ) -> tuple[ReqCache, StateOps] | None:
        """Take a request row, its state slots and KV for tokens [0, first_len).

        Returns the request's resources and the deferred resume op (copy of the matched state
        into the working slot, or a clear), or None with nothing taken. ``spare``: the states
        and KV eviction leaves alone (``evict_policy``; pinned states and their prefixes' KV
        while running requests can free slots instead).
        """
        node = match.node if self.tree is not None else None
        if node is not None:
            self.tree.lock(node)
            if match.prefix_len > 0:
                self.tree.lock_state(node)
        row = self.req_slots.alloc()
        slots = self._alloc_state(self.state_slots_per_req, spare) if row is not None else None
        if slots is None:
            if row is not None:
                self.req_slots.free(row)
            self._unlock(node, match.prefix_len > 0)
            return None
        rc = ReqCache(
            row=row,
            state_slot=slots[0],
            track_slots=slots[1:],
            node=node,
            tree_len=match.prefix_len,
            kv_alloc=match.prefix_len,
            state_node=node if match.prefix_len > 0 else None,
        )
        if match.prefix_len:
            self.req_slots.table[row, : match.prefix_len] = match.kv_slots
        self.live.add(rc)
        if not self.ensure_kv(rc, first_len, spare):
            self.release(rc)
            return None
        ops = StateOps()
        if match.prefix_len > 0:
            if self._write_policy == WRITE_THROUGH_SELECTIVE and not node.stored:
                self._stage(node)  # a prefix used a second time: worth keeping
            ops.add_copy(node.state_slot, rc.state_slot)
        else:
            ops.clear.append(rc.state_slot)
        return rc, ops

    def resume_done(self, rc: ReqCache) -> None:
        """The resume copy has executed: the source state no longer needs protection."""
        if rc.state_node is not None:
            self.tree.unlock_state(rc.state_node)
            rc.state_node = None

    def ensure_kv(self, rc: ReqCache, length: int, spare: int = SPARE_NOTHING) -> bool:
        """Make sure the request's row has KV slots for tokens [0, length) (whole pages),
        evicting no KV that ``spare`` protects."""
        need = -(-length // self.page_size) * self.page_size - rc.kv_alloc
        if need <= 0:
            return True
        slots = self._alloc_kv(need, spare)
        if slots is None:
            return False
        self.req_slots.table[rc.row, rc.kv_alloc : rc.kv_alloc + need] = slots
        rc.kv_alloc += need
        return True

    def ensure_kv_many(self, rcs: list[ReqCache], lengths: list[int]) -> list[bool]:
        """``ensure_kv`` for many requests (a decode step) with one allocation when the pool
        has room for all of them; otherwise one by one, which may leave some without."""
        needs = [
            -(-n // self.page_size) * self.page_size - rc.kv_alloc for rc, n in zip(rcs, lengths)
        ]
        total = sum(n for n in needs if n > 0)
        if total == 0:
            return [True] * len(rcs)
        slots = self._alloc_kv(total)
        if slots is None:
            return [self.ensure_kv(rc, n) for rc, n in zip(rcs, lengths)]
        rows: list[int] = []
        cols: list[int] = []
        for rc, need in zip(rcs, needs):
            if need > 0:
                rows += [rc.row] * need
                cols += range(rc.kv_alloc, rc.kv_alloc + need)
                rc.kv_alloc += need
        self.req_slots.table[torch.tensor(rows), torch.tensor(cols)] = slots
        return [True] * len(rcs)

    def kv_slots(self, rc: ReqCache, length: int) -> torch.Tensor:
        """A copy of the KV slots of tokens [0, length) (safe to hand to an in-flight forward)."""
        return self.req_slots.table[rc.row, :length].clone()

    def kv_slots_many(self, rcs: list[ReqCache], length: int) -> torch.Tensor:
        """A copy of the first ``length`` KV slots of many requests' rows, ``[len(rcs), length]``,
        in one gather (row i's entries past that request's tokens are meaningless)."""
        rows = torch.tensor([rc.row for rc in rcs], dtype=torch.long)
        return self.req_slots.table[:, :length].index_select(0, rows)

    # ------------------------------------------------------------------ snapshots

    def alloc_snapshot_slot(self, rc: ReqCache, spare: int = SPARE_SHARED) -> int | None:
        """no_buffer: a new slot for a recorded working -> snapshot copy (held until inserted);
        ``spare``: what eviction leaves alone for it (a branch point's spares only pins)."""
        got = self._alloc_state(1, spare)
        if got is None:
            self.stats.skipped_snapshots += 1
            return None
        rc.pending.append(got[0])
        return got[0]

    def insert_snapshot(
        self, rc: ReqCache, tokens: list[int], length: int, slot: int
    ) -> TreeNode | None:
        """no_buffer: the copy into ``slot`` has run; move it into the tree at ``length``.
        Returns the node holding the state at ``length`` (the slot's, or the one the tree had
        there already, when the slot is freed)."""
        rc.pending.remove(slot)
        self.stats.snapshot_attempts += 1
        node, attached = self._insert(rc, tokens, length, slot)
        if not attached:
            self.state_pool.free([slot])
        return node

    def donate_track(
        self, rc: ReqCache, index: int, tokens: list[int], length: int, spare: int = SPARE_SHARED
    ) -> TreeNode | None:
        """extra_buffer: the forward wrote the state at ``length`` into track slot ``index``;
        give that slot to the tree (no copy) and take a fresh one in its place. Returns the
        node holding the state at ``length`` (the slot's, or the one the tree had there
        already; None: skipped). ``spare`` as ``alloc_snapshot_slot``'s."""
        fresh = self._alloc_state(1, spare)
        if fresh is None:
            self.stats.skipped_snapshots += 1
            return None
        self.stats.snapshot_attempts += 1
        node, attached = self._insert(rc, tokens, length, rc.track_slots[index])
        if attached:
            rc.track_slots[index] = fresh[0]
        else:
            self.state_pool.free(fresh)
        return node

    # ------------------------------------------------------------------ speculative decoding

    def alloc_spec_slots(self, rc: ReqCache, n: int) -> bool:
        """``n`` scratch slots for a verify step's states after each draft token (evicting if
        needed); False (nothing taken) when the pool cannot give them."""
        got = self._alloc_state(n, SPARE_SHARED)
        if got is None:
            return False
        rc.spec_slots = got
        return True

    def settle_spec(self, rc: ReqCache, kept: int) -> None:
        """A verify step kept ``kept`` of its input tokens (the last sampled one and the
        accepted drafts): the state after them becomes the working state. The working slot
        holds the state after all of them; a scratch slot the state after ``kept`` when fewer
        were kept, and then it becomes the working slot (no copy). The rest are freed."""
        spare = rc.spec_slots
        rc.spec_slots = []
        if 1 <= kept <= len(spare):
            kept_slot = spare[kept - 1]
            spare = spare[: kept - 1] + spare[kept:] + [rc.state_slot]
            rc.state_slot = kept_slot
        self.state_pool.free(spare)

    # ------------------------------------------------------------------ end of a request

    def finish(
        self,
        rc: ReqCache,
        tokens: list[int],
        fed_len: int,
        tracked: tuple[int, int] | None = None,
    ) -> None:
        """Cache what the request computed (KV of tokens [0, fed_len) and the working state at
        fed_len, donated without a copy), then release the rest. Also used on retraction, so a
        re-queued request resumes where it stopped.

        The tree keeps whole pages only: when fed_len is not page-aligned, ``tracked``
        ``(position, track index)`` names a tracking slot holding the state at an earlier page
        boundary, which is donated instead."""
        if self.tree is not None and fed_len > rc.tree_len:
            if fed_len % self.page_size == 0:
                if self._insert(rc, tokens, fed_len, rc.state_slot)[1]:
                    rc.state_slot = -1
            elif tracked is not None and rc.tree_len < tracked[0] <= fed_len:
                slot = rc.track_slots[tracked[1]]
                if self._insert(rc, tokens, tracked[0], slot)[1]:
                    rc.track_slots.remove(slot)
        self.release(rc)

    def release(self, rc: ReqCache) -> None:
        """Free everything the request owns; its tree prefix stays (abort, or after finish)."""
        self.resume_done(rc)
        owned = self.req_slots.table[rc.row, rc.tree_len : rc.kv_alloc]
        if owned.numel():
            self.kv_pool.free(owned.clone())
        states = list(rc.track_slots) + rc.pending + rc.spec_slots
        if rc.state_slot >= 0:
            states.append(rc.state_slot)
        self.state_pool.free(states)
        if self.tree is not None and rc.node is not None:
            self.tree.unlock(rc.node)
        self.req_slots.free(rc.row)
        self.live.discard(rc)
        rc.track_slots, rc.pending, rc.spec_slots = [], [], []
        rc.state_slot, rc.node = -1, None

    def flush(self) -> int | None:
        """Empty the prefix cache (SGLang's ``/flush_cache``): None, and nothing freed, while
        any request is live (it may hold cached prefixes or be about to insert); otherwise the
        number of KV slots freed (0 with the cache disabled)."""
        if self.live or self.loading:
            return None
        if self.tree is None:
            return 0
        self.pending_writes = []  # their nodes go with the tree (no forward is in flight)
        return self.tree.flush()

    # ------------------------------------------------------------------ accounting

    def token_usage(self) -> float:
        evictable = self.tree.evictable_kv() if self.tree is not None else 0
        return (self.kv_pool.size - self.kv_pool.available() - evictable) / self.kv_pool.size

    def mamba_usage(self) -> float:
        evictable = self.tree.evictable_state() if self.tree is not None else 0
        size = self.state_pool.size
        return (size - self.state_pool.available() - evictable) / size

    def held_slots(self) -> tuple[list[int], list[int]]:
        kv: list[int] = []
        states: list[int] = []
        for rc in self.live:
            kv.extend(self.req_slots.table[rc.row, rc.tree_len : rc.kv_alloc].tolist())
            states.extend(rc.track_slots + rc.pending + rc.spec_slots)
            if rc.state_slot >= 0:
                states.append(rc.state_slot)
        for t in self.loading.values():
            kv.extend(t.job.kv_slots.tolist())
            states.append(t.job.state_slot)
        return kv, states

    def check_integrity(self, owners: Iterable[ReqCache] | None = None) -> None:
        """Every KV slot and state slot is free, in the tree, or held by exactly one live
        request; each live request's tree-owned prefix matches the tree's path; every lock
        count of the tree equals the live requests holding it. With ``owners`` (the resources
        of the requests the scheduler holds), the live entries must be exactly those."""
        held_kv, held_state = self.held_slots()
        if len(self.live) + self.req_slots.available() != self.req_slots.num_rows:
            raise IntegrityError(
                f"request rows: {len(self.live)} live + {self.req_slots.available()} free "
                f"!= {self.req_slots.num_rows}"
            )
        if owners is not None:
            self._check_owners(list(owners))
        if self.tree is not None:
            self.tree.check_integrity(held_kv=held_kv, held_state=held_state)
            for rc in self.live:
                path = self.tree.path_kv(rc.node)
                if not torch.equal(path, self.req_slots.table[rc.row, : rc.tree_len]):
                    raise IntegrityError(f"row {rc.row}: tree-owned prefix differs from tree path")
            self._check_locks()
            self._check_stored()
            return
        for name, free, held, size in (
            ("KV", self.kv_pool.free_slot_list(), held_kv, self.kv_pool.size),
            ("state", self.state_pool.free_slot_list(), held_state, self.state_pool.size),
        ):
            everything = free + held
            if len(everything) != size or len(set(everything)) != size:
                raise IntegrityError(
                    f"{name} slots: {len(free)} free + {len(held)} held != {size} (or duplicated)"
                )

    def _check_owners(self, owners: list[ReqCache]) -> None:
        ids = {id(rc) for rc in owners}
        if len(ids) != len(owners):
            raise IntegrityError("two requests hold the same cache resources")
        leaked = [rc for rc in self.live if id(rc) not in ids]
        if leaked:
            raise IntegrityError(
                f"leaked request: {len(leaked)} live cache entries (row {leaked[0].row} first) "
                "belong to no request the scheduler holds"
            )
        gone = [rc for rc in owners if rc not in self.live]
        if gone:
            raise IntegrityError(
                f"a request holds cache resources that were released (row {gone[0].row})"
            )

    def _check_locks(self) -> None:
        """kv_lock of a node = live requests whose locked node is it or below it; state_lock =
        live requests resuming from its state (the root keeps its one permanent kv lock)."""
        kv_want: dict[int, int] = {}
        state_want: dict[int, int] = {}
        for rc in self.live:
            node = rc.node
            while node is not None and node.parent is not None:
                kv_want[id(node)] = kv_want.get(id(node), 0) + 1
                node = node.parent
            if rc.state_node is not None and rc.state_node.parent is not None:
                key = id(rc.state_node)
                state_want[key] = state_want.get(key, 0) + 1
        for t in self.loading.values():  # a load holds the RAM part of its path
            node = t.node
            while node.parent is not None:
                kv_want[id(node)] = kv_want.get(id(node), 0) + 1
                node = node.parent
        stack = list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            want_kv, want_state = kv_want.get(id(node), 0), state_want.get(id(node), 0)
            if node.kv_lock != want_kv or node.state_lock != want_state:
                raise IntegrityError(
                    f"lock counts kv {node.kv_lock} / state {node.state_lock}, but {want_kv} / "
                    f"{want_state} live requests hold them: {node!r}"
                )

    # ------------------------------------------------------------------ the storage tier

    @property
    def _write_policy(self) -> str | None:
        return self.storage.write_policy if self.storage is not None else None

    def _stage(self, node: TreeNode) -> None:
        """Write ``node``'s prefix and state to storage (copied out now, written later)."""
        tokens = self.tree.path_tokens(node)
        if self.storage.stage(tokens, self.tree.path_kv(node), node.state_slot):
            node.stored = True

    def _demote(self, node: TreeNode) -> None:
        """The tree is about to free ``node``'s state: under write-back write it first (the
        write-through policies wrote it already, or chose not to); a write that failed is
        tried again."""
        if not node.stored:
            if self._write_policy == WRITE_BACK:
                self._stage(node)
        elif self.storage.write_failed(self.tree.path_tokens(node)):
            self._stage(node)  # its earlier write failed (a full disk, Redis down): retry

    def start_load(
        self, tokens: list[int], match: MatchResult, limit: int | None, s_per_token: float = 0.0
    ) -> LoadTicket | None:
        """If storage holds a deeper prefix of ``tokens`` than the RAM tree (``match``), at
        least one snapshot alignment deeper and worth reading, start loading it into fresh
        slots (taking them may evict RAM entries) and return the ticket the request waits on;
        a load of the same state already running is shared. None: recompute."""
        if self.storage is None:
            return None
        cap = len(tokens) - 1 if limit is None else min(limit, len(tokens) - 1)
        tree = self.tree
        found = self.storage.probe(
            tokens,
            cap,
            match.prefix_len,
            lambda q: tree.deepest_node(tokens, q).depth,
            min_gain=self.storage.block,
        )
        if found is None:
            return None
        for t in self.loading.values():
            if t.job.prefix.state_key == found.state_key:
                return t
        if not self.storage.worth_loading(found, found.position - match.prefix_len, s_per_token):
            return None
        node = tree.deepest_node(tokens, found.position)  # at found.ram_depth
        tree.lock(node)  # the RAM part of the path stays while the rest is read
        kv = self._alloc_kv(found.position - node.depth, SPARE_PINNED)
        state = self._alloc_state(1, SPARE_PINNED) if kv is not None else None
        if state is None:
            if kv is not None:
                self.kv_pool.free(kv)
            self.tree.unlock(node)
            return None
        job = self.storage.load(found, kv, state[0])
        ticket = LoadTicket(list(tokens[: found.position]), node, job)
        self.loading[found.state_key] = ticket
        return ticket

    def poll_loads(self, wait: float = 0.0) -> int:
        """Collect finished loads (waiting up to ``wait`` seconds for one when none has
        finished): a good one is inserted into the tree, a failed one's slots are freed.
        Returns how many were collected."""
        if not self.loading:
            return 0
        if wait > 0 and not any(t.job.future.done() for t in self.loading.values()):
            wait_any([t.job.future for t in self.loading.values()], wait, FIRST_COMPLETED)
        done = [(k, t) for k, t in self.loading.items() if t.job.future.done()]
        for key, t in done:
            del self.loading[key]
            self._collect(t)
        return len(done)

    def _collect(self, t: LoadTicket) -> None:
        job = t.job
        write = None
        try:
            write = job.future.result()
        except Exception as exc:  # an I/O thread fault: this load recomputes
            logger.error("storage load failed: %r", exc, exc_info=exc)
        t.ok = write is not None
        if t.ok:
            self.pending_writes.append(write)
            kv = torch.cat([self.tree.path_kv(t.node), job.kv_slots])
            res = self.tree.insert(t.tokens, kv, job.state_slot, owned_from=t.node.depth)
            if res.state_attached:
                res.node.stored = True  # it came from there
                self.stats.storage_loaded_tokens += t.position - t.node.depth
            else:  # a state appeared there meanwhile (computed by a request)
                self.state_pool.free([job.state_slot])
            if res.node.state_slot is not None and res.node.depth == len(t.tokens):
                t.landed = res.node
        else:
            self.kv_pool.free(job.kv_slots)
            self.state_pool.free([job.state_slot])
        self.tree.unlock(t.node)
        t.done = True

    def take_writes(self) -> list:
        """The loads' pool writes not yet handed to a forward (see ``pending_writes``)."""
        writes, self.pending_writes = self.pending_writes, []
        return writes

    def close_storage(self, timeout: float = 60.0) -> None:
        """At shutdown: under write-back, write every state the tree holds only in RAM, then
        finish the writes and stop the tier. Call with no engine step running."""
        if self.storage is None:
            return
        while self.loading:
            self.poll_loads(wait=timeout)
        for write in self.take_writes():  # no forward runs now: the pools are ours
            write()
        if self._write_policy == WRITE_BACK:
            stack = list(self.tree.root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node.state_slot is not None and not node.stored:
                    self._stage(node)
        self.storage.close(timeout)

    def _check_stored(self) -> None:
        """Every node marked stored was handed to the tier under its content key."""
        if self.storage is None:
            return
        stack = list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.stored and not self.storage.knows(self.tree.path_tokens(node)):
                raise IntegrityError(
                    f"node marked stored but unknown to the storage tier: {node!r}"
                )

    # ------------------------------------------------------------------ internals

    def _insert(
        self, rc: ReqCache, tokens: list[int], length: int, state_slot: int
    ) -> tuple[TreeNode | None, bool]:
        """Insert tokens[:length] with the request's KV and a state; keep the row pointing at
        the tree's slots and move the request's lock down to the new node. Returns the node
        holding the state at ``length`` (None: none does) and whether the tree took this one
        (False: it had one there already, which the node holds)."""
        tree = self.tree
        owned_from = min(rc.tree_len, length)
        kv = self.req_slots.table[rc.row, :length].clone()
        res = tree.insert(tokens[:length], kv, state_slot, owned_from=owned_from)
        if length > rc.tree_len:
            self.req_slots.table[rc.row, :length] = tree.path_kv(res.node)
            tree.lock(res.node)
            tree.unlock(rc.node)
            rc.node, rc.tree_len = res.node, length
        if res.state_attached:
            self.stats.snapshots_inserted += 1
            if self._write_policy == WRITE_THROUGH:
                self._stage(res.node)
        held = res.node.state_slot is not None and res.node.depth == length
        return (res.node if held else None), res.state_attached

    def _alloc_state(self, n: int, spare: int = SPARE_NOTHING) -> list[int] | None:
        """``n`` state slots, evicting tree states if short, none that ``spare`` protects."""
        short = n - self.state_pool.available()
        if short > 0 and self.tree is not None:
            self.stats.evicted_states += self.tree.evict_state(short, spare)
        return self.state_pool.alloc(n)

    def _alloc_kv(self, n: int, spare: int = SPARE_NOTHING) -> torch.Tensor | None:
        short = n - self.kv_pool.available()
        if short > 0 and self.tree is not None:
            self.stats.evicted_kv_tokens += self.tree.evict_kv(short, spare)
        return self.kv_pool.alloc(n)

    def _unlock(self, node: TreeNode | None, state: bool) -> None:
        if self.tree is None or node is None:
            return
        if state:
            self.tree.unlock_state(node)
        self.tree.unlock(node)
