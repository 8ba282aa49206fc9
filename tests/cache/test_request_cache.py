"""Request-level cache operations without a model or scheduler: admission records the resume
as a deferred op, extra_buffer donates tracking slots (no copy), no_buffer snapshots are
recorded copies, finish donates the working slot, and the disabled mode frees everything."""

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


def make(strategy="extra_buffer", enabled=True, page=1, states=16, kv=256):
    kvp = KVPool(KVSpec(1, 1, 1), kv, page)
    sp = StatePool(SPEC, states)
    return RequestCache(kvp, sp, ReqSlots(4, 128), enabled=enabled, strategy=strategy)


def run_request(cache, tokens, fed):
    """Admit, grow to ``fed`` tokens, finish; returns the deferred resume ops."""
    m = cache.match(tokens)
    rc, ops = cache.admit(m, fed)
    cache.resume_done(rc)
    cache.check_integrity()
    cache.finish(rc, tokens, fed)
    cache.check_integrity()
    return m, ops


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_finish_donates_working_slot_and_next_request_resumes(strategy):
    cache = make(strategy)
    a = list(range(1, 41))
    m, ops = run_request(cache, a, 40)
    assert m.prefix_len == 0 and ops.clear and not ops.copy_src  # fresh: cleared, not copied
    assert cache.state_pool.copies == 0  # the working slot moved into the tree as it is
    assert cache.tree.total_state() == 1
    m2, ops2 = run_request(cache, a + [99, 98], 42)
    assert m2.prefix_len == 40
    assert len(ops2.copy_src) == 1 and ops2.copy_src[0] == m2.node.state_slot  # resume = copy
    assert not ops2.clear


def test_extra_buffer_holds_three_slots_and_donates_without_copy():
    cache = make("extra_buffer")
    tokens = list(range(1, 100))
    rc, _ = cache.admit(cache.match(tokens), 99)
    assert len(rc.track_slots) == 2 and cache.state_pool.available() == 16 - 3
    donated = rc.track_slots[0]
    cache.donate_track(rc, 0, tokens, 64)
    assert rc.track_slots[0] != donated  # a fresh slot took its place
    node = cache.tree.match(tokens[:70]).node
    assert node.depth == 64 and node.state_slot == donated
    assert rc.tree_len == 64 and rc.node is node  # the request's lock moved down
    cache.check_integrity()
    cache.release(rc)
    cache.check_integrity()
    assert cache.state_pool.copies == 0


def test_no_buffer_snapshot_is_a_held_slot_until_inserted():
    cache = make("no_buffer")
    tokens = list(range(1, 100))
    rc, _ = cache.admit(cache.match(tokens), 99)
    assert rc.track_slots == []
    slot = cache.alloc_snapshot_slot(rc)
    assert slot in rc.pending
    cache.check_integrity()  # counted as held by the request
    cache.insert_snapshot(rc, tokens, 64, slot)
    assert rc.pending == [] and cache.tree.match(tokens[:80]).prefix_len == 64
    cache.release(rc)
    cache.check_integrity()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_a_snapshot_where_the_tree_has_one_returns_that_node(strategy):
    """Two requests' snapshots at the same position: the second's slot is freed (not
    attached) and the node the tree already had there is returned, so the strategy still
    marks it a branch point or pins it for waiting requests (a None here once left it
    unprotected)."""
    cache = make(strategy)
    tokens = list(range(1, 100))
    rcs = [cache.admit(cache.match(tokens), 99)[0] for _ in range(2)]
    nodes = []
    for rc in rcs:
        if strategy == "no_buffer":
            nodes.append(cache.insert_snapshot(rc, tokens, 64, cache.alloc_snapshot_slot(rc)))
        else:
            donated = rc.track_slots[0]
            nodes.append(cache.donate_track(rc, 0, tokens, 64))
        cache.check_integrity()
    assert nodes[0] is nodes[1] and nodes[0].depth == 64
    assert cache.stats.snapshots_inserted == 1
    if strategy == "extra_buffer":
        assert rcs[1].track_slots[0] == donated  # kept: the tree took none of its slots
    for rc in rcs:
        cache.release(rc)
    cache.check_integrity()
    assert cache.tree.total_state() == 1


def test_snapshot_without_a_slot_is_skipped_and_counted():
    cache = make("no_buffer", states=1)
    tokens = list(range(1, 50))
    rc, _ = cache.admit(cache.match(tokens), 49)
    assert cache.alloc_snapshot_slot(rc) is None
    assert cache.stats.skipped_snapshots == 1
    cache.release(rc)
    cache.check_integrity()


def test_admission_fails_cleanly_when_pools_are_short():
    cache = make("extra_buffer", states=2)
    assert cache.admit(cache.match([1, 2, 3]), 3) is None  # needs 3 state slots
    cache.check_integrity()
    assert cache.state_pool.available() == 2 and cache.req_slots.available() == 4
    small = make("no_buffer", kv=16)
    assert small.admit(small.match(list(range(40))), 40) is None  # KV too small
    small.check_integrity()
    assert small.kv_pool.available() == 16


def test_duplicate_kv_is_freed_and_row_points_at_tree_slots():
    cache = make("no_buffer")
    a = list(range(1, 30))
    run_request(cache, a, 29)
    # a second request that computed the same tokens itself (no state matched at its limit)
    rc, _ = cache.admit(cache.match(a[:20] + [77]), 21)
    mine = cache.req_slots.table[rc.row, :20].clone()
    before = cache.kv_pool.available()
    cache.finish(rc, a[:20] + [77], 21)
    cache.check_integrity()
    tree_slots = cache.tree.path_kv(cache.tree.match(a).node)[:20]
    assert not torch.equal(mine, tree_slots)
    assert cache.kv_pool.available() == before + 20  # its 20 duplicates went back


def test_disabled_mode_frees_everything_and_integrity_catches_a_leak():
    cache = make(enabled=False)
    tokens = list(range(1, 33))
    m, ops = run_request(cache, tokens, 32)
    assert cache.tree is None and m.prefix_len == 0 and ops.clear
    assert cache.kv_pool.available() == 256 and cache.state_pool.available() == 16
    cache.state_pool.alloc(1)  # negative control: a slot nobody owns
    with pytest.raises(IntegrityError):
        cache.check_integrity()


@pytest.mark.parametrize("page", [1, 4])
def test_ensure_kv_many_matches_one_by_one_and_falls_back_when_short(page):
    """A decode step's KV growth in one allocation: every request gets the slots for its next
    token (whole pages), rows and counts as ``ensure_kv`` would leave them; when the pool cannot
    hold all of them, requests are served one by one and the rest get nothing (no leak)."""
    cache = make(page=page, kv=32 * page, states=16)
    rcs = []
    for i in range(3):
        tokens = [100 * (i + 1) + t for t in range(5 * page)]
        rc, _ = cache.admit(cache.match(tokens), 5 * page)
        cache.resume_done(rc)
        rcs.append(rc)
    before = [rc.kv_alloc for rc in rcs]
    assert cache.ensure_kv_many(rcs, [5 * page + 1] * 3) == [True] * 3
    assert [rc.kv_alloc for rc in rcs] == [b + page for b in before]
    rows = cache.kv_slots_many(rcs, 5 * page + 1)
    for rc, row in zip(rcs, rows):
        torch.testing.assert_close(row, cache.kv_slots(rc, 5 * page + 1))
    assert len(set(rows[:, -1].tolist())) == 3  # distinct new slots
    cache.check_integrity()
    # short: leave room for exactly one more page, ask for one each
    free = cache.kv_pool.available()
    hog = cache.kv_pool.alloc(free - page)
    got = cache.ensure_kv_many(rcs, [6 * page + 1] * 3)
    assert got == [True, False, False] and cache.kv_pool.available() == 0
    cache.kv_pool.free(hog)
    for rc in rcs:
        cache.release(rc)
    cache.check_integrity()
