"""check_integrity(): a healthy tree passes, and each deliberately broken invariant is reported
(negative controls: a check that never fires would pass every other test silently)."""

from __future__ import annotations

import pytest
from test_radix_helpers import make_tree, put, seq

from mambaradix.cache.radix import IntegrityError


def _tree():
    tree, kv_pool, state_pool = make_tree()
    put(tree, [1, 2, 3])
    put(tree, seq(1, 7))
    put(tree, [10, 11, 12])
    put(tree, [1, 2, 3, 4, 5, 60, 70])
    tree.check_integrity()  # positive control
    return tree, kv_pool, state_pool


def test_healthy_tree_with_held_slots_passes():
    tree, kv_pool, state_pool = _tree()
    kv = kv_pool.alloc(5)
    st = state_pool.alloc(2)
    tree.check_integrity(held_kv=kv.tolist(), held_state=st)


def test_leaked_kv_slot_is_reported():
    tree, kv_pool, _ = _tree()
    kv_pool.alloc(1)  # taken by nobody
    with pytest.raises(IntegrityError, match="KV slot .* leaked"):
        tree.check_integrity()


def test_leaked_state_slot_is_reported():
    tree, _, state_pool = _tree()
    state_pool.alloc(1)
    with pytest.raises(IntegrityError, match="state slot .* leaked"):
        tree.check_integrity()


def test_duplicated_kv_slot_is_reported():
    tree, kv_pool, _ = _tree()
    leaf = tree.root.children[10]
    kv_pool.free(leaf.kv[:1])  # freed while the tree still holds it
    with pytest.raises(IntegrityError, match="KV slot .* duplicated"):
        tree.check_integrity()


def test_held_slot_also_in_tree_is_reported():
    tree, _, _ = _tree()
    leaf = tree.root.children[10]
    with pytest.raises(IntegrityError, match="duplicated"):
        tree.check_integrity(held_state=[leaf.state_slot])


def test_tombstone_leaf_is_reported():
    tree, _, state_pool = _tree()
    leaf = tree.root.children[10]
    tree.policy.remove(leaf)
    state_pool.free([leaf.state_slot])
    leaf.state_slot = None
    tree._evictable_state -= 1  # everything else consistent: only the tombstone leaf is wrong
    with pytest.raises(IntegrityError, match="tombstone leaf"):
        tree.check_integrity()


def test_broken_kv_lru_order_is_reported():
    tree, _, _ = _tree()
    oldest = tree.kv_lru.oldest()
    oldest.tick = 10**9  # claims a newer access than everything after it
    with pytest.raises(IntegrityError, match="KV-LRU out of access order"):
        tree.check_integrity()


def test_parent_older_than_child_is_reported():
    tree, _, _ = _tree()
    parent = tree.root.children[1]  # [1, 2, 3], internal
    tree.kv_lru.remove(parent.kv_link)
    tree.kv_lru.insert_newer_than(tree.kv_lru.oldest(), parent.kv_link)
    parent.kv_link.tick = 0
    tree.kv_lru.oldest().tick = 0
    with pytest.raises(IntegrityError, match="parent older than its child"):
        tree.check_integrity()


def test_broken_state_lru_order_is_reported():
    tree, _, _ = _tree()
    tree.policy.lru.oldest().tick = 10**9
    with pytest.raises(IntegrityError, match="state LRU out of access order"):
        tree.check_integrity()


def test_locked_node_in_kv_lru_is_reported():
    tree, _, _ = _tree()
    leaf = tree.root.children[10]
    leaf.kv_lock += 1
    tree._evictable_kv -= 3
    tree._protected_kv += 3
    with pytest.raises(IntegrityError, match="locked node"):
        tree.check_integrity()


def test_wrong_counters_are_reported():
    for name in ("_evictable_kv", "_protected_kv", "_evictable_state", "_protected_state"):
        tree, _, _ = _tree()
        setattr(tree, name, getattr(tree, name) + 1)
        with pytest.raises(IntegrityError, match="counter"):
            tree.check_integrity()


def test_inconsistent_lock_counts_are_reported():
    tree, _, _ = _tree()
    m = tree.match(seq(1, 7))
    tree.lock(m.node)
    tree.check_integrity()
    m.node.parent.kv_lock -= 1  # a child claims more lockers than its parent carries
    with pytest.raises(IntegrityError, match="kv_lock"):
        tree.check_integrity()


def test_wrong_depth_is_reported():
    tree, _, _ = _tree()
    tree.root.children[10].depth += 1
    with pytest.raises(IntegrityError, match="depth"):
        tree.check_integrity()
