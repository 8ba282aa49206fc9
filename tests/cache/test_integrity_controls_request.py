"""Negative controls for every check of the request cache's integrity check (live requests
held against the tree, the pools and each other; the disabled-cache mode): a healthy cache,
one corruption as a real bug would make it, and the check meant for it fires."""

from __future__ import annotations

import pytest
import torch

from mambaradix.cache.integrity import IntegrityError
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.request_cache import RequestCache
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec

SPEC = StateSpec((StateLayerSpec(conv_shape=(2, 3), temporal_shape=(1, 2, 2)),))


def _request_cache(enabled: bool = True) -> tuple[RequestCache, object]:
    """A cache whose tree holds a finished 40-token request, and a live request resuming from
    it (tree_len 40) grown to 44 tokens; or, disabled, one live request of 44 tokens."""
    cache = RequestCache(
        KVPool(KVSpec(1, 1, 1), 256, 1), StatePool(SPEC, 16), ReqSlots(4, 128), enabled=enabled
    )
    a = list(range(1, 41))
    if enabled:
        rc, _ = cache.admit(cache.match(a), 40)
        cache.resume_done(rc)
        cache.finish(rc, a, 40)
    rc, _ = cache.admit(cache.match(a + [99, 98, 97, 96]), 42)
    cache.resume_done(rc)
    assert cache.ensure_kv(rc, 44)
    assert rc.tree_len == (40 if enabled else 0)
    cache.check_integrity()  # positive control
    return cache, rc


def _free_slot(pool) -> int:
    return pool.free_slot_list()[0]


REQUEST_CASES = [
    (
        "request_forgotten",
        True,
        lambda c, rc: c.live.discard(rc),
        r"request rows: 0 live \+ 3 free != 4",
    ),
    (
        "row_freed_while_live",
        True,
        lambda c, rc: c.req_slots.free(rc.row),
        r"request rows: 1 live \+ 4 free != 4",
    ),
    (
        "row_taken_by_nobody",
        False,
        lambda c, rc: c.req_slots.alloc(),
        r"request rows: 1 live \+ 2 free != 4",
    ),
    # The row's tree-owned part points at a slot that is not the tree's (held slots are the
    # row's [tree_len, kv_alloc) only, so the slot accounting cannot see it).
    (
        "tree_prefix_overwritten",
        True,
        lambda c, rc: c.req_slots.table[rc.row].__setitem__(3, _free_slot(c.kv_pool)),
        r"row 0: tree-owned prefix differs from tree path",
    ),
    (
        "request_node_stale",
        True,
        lambda c, rc: setattr(rc, "node", c.tree.root),
        r"row 0: tree-owned prefix differs from tree path",
    ),
    # Slot accounting of live requests goes through the tree's check (held_kv / held_state).
    (
        "pending_snapshot_dropped",
        True,
        lambda c, rc: (c.alloc_snapshot_slot(rc), rc.pending.pop()),
        r"^state slot \d+ is leaked \(in no place\) \(free: 0, tree: 0, held: 0\)",
    ),
    (
        "inserted_snapshot_still_pending",
        True,
        lambda c, rc: rc.pending.append(c.tree.match(list(range(1, 41))).node.state_slot),
        r"^state slot \d+ is duplicated \(free: 0, tree: 1, held: 1\)",
    ),
    (
        "request_kv_freed_while_held",
        True,
        lambda c, rc: c.kv_pool.free(c.req_slots.table[rc.row, 40:41].clone()),
        r"^KV slot \d+ is duplicated \(free: 1, tree: 0, held: 1\)",
    ),
    # Disabled cache: every slot free or held, counted and deduplicated. A leak shrinks both
    # the count and the set; only a double free needs the count, only a slot in two places
    # with another in none needs the set.
    (
        "disabled_kv_leaked",
        False,
        lambda c, rc: c.kv_pool.alloc(1),
        r"KV slots: 211 free \+ 44 held != 256",
    ),
    (
        "disabled_kv_double_freed",
        False,
        lambda c, rc: c.kv_pool.free(torch.tensor([_free_slot(c.kv_pool)])),
        r"KV slots: 213 free \+ 44 held != 256",
    ),
    # Same total, one slot twice and one in no place: only the deduplicated count sees it.
    (
        "disabled_row_points_at_free_kv",
        False,
        lambda c, rc: c.req_slots.table[rc.row].__setitem__(0, _free_slot(c.kv_pool)),
        r"KV slots: 212 free \+ 44 held != 256 \(or duplicated\)",
    ),
    (
        "disabled_state_leaked",
        False,
        lambda c, rc: c.state_pool.alloc(1),
        r"state slots: 14 free \+ 1 held != 16",
    ),
    (
        "disabled_state_is_a_free_slot",
        False,
        lambda c, rc: setattr(rc, "state_slot", _free_slot(c.state_pool)),
        r"state slots: 15 free \+ 1 held != 16 \(or duplicated\)",
    ),
]


@pytest.mark.parametrize(
    ("enabled", "corrupt", "pattern"),
    [pytest.param(enabled, fn, pat, id=name) for name, enabled, fn, pat in REQUEST_CASES],
)
def test_request_cache_corruption_fires_its_check(enabled, corrupt, pattern):
    cache, rc = _request_cache(enabled)
    corrupt(cache, rc)
    with pytest.raises(IntegrityError, match=pattern):
        cache.check_integrity()
