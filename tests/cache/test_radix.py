"""Scenario tests of the radix tree with hand-checked expectations."""

from __future__ import annotations

import pytest
import torch
from test_radix_helpers import as_list, make_tree, put, seq, shape

from mambaradix.cache.evict_policy import SPARE_PINNED, SPARE_SHARED, STATE_POLICIES


def test_issue_scenario_split_lru_eviction_and_state_eviction():
    tree, kv_pool, state_pool = make_tree()
    for tokens in ([1, 2, 3], seq(1, 7), [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        put(tree, tokens)
        tree.check_integrity()
    assert shape(tree) == {
        ((1, 2, 3), True): {((4, 5), False): {((6, 7), True): {}, ((60, 70), True): {}}},
        ((10, 11, 12), True): {},
    }
    assert tree.num_nodes() == 5
    assert tree.total_kv() == 12 and kv_pool.available() == 256 - 12
    assert tree.total_state() == 4

    m = tree.match(seq(1, 7))
    assert (m.kv_len, m.prefix_len) == (7, 7)
    assert as_list(m.kv_slots) == as_list(tree.path_kv(m.node))

    assert tree.evict_kv(1) == 3  # [10, 11, 12]: least recently used leaf
    assert ((10, 11, 12), True) not in shape(tree)
    assert tree.evict_state(1) == 1  # [1, 2, 3]: its state was only passed through
    assert shape(tree) == {
        ((1, 2, 3), False): {((4, 5), False): {((6, 7), True): {}, ((60, 70), True): {}}},
    }
    tree.check_integrity()

    m = tree.match(seq(1, 5))
    assert (m.kv_len, m.prefix_len) == (5, 0) and m.node is tree.root
    assert tree.match(seq(1, 7)).prefix_len == 7
    before = tree.num_nodes()
    m = tree.match([1, 2, 3, 4])  # ends mid-edge: must not split
    assert (m.kv_len, m.prefix_len, tree.num_nodes()) == (4, 0, before)
    tree.check_integrity()


def test_match_touches_only_the_used_state():
    tree, *_ = make_tree()
    put(tree, [1, 2, 3])
    put(tree, [9])
    put(tree, seq(1, 6))
    assert tree.match(seq(1, 6)).prefix_len == 6  # passes through the state at 3
    tree.evict_state(1)
    # Touching the passed-through state would have made [9] the victim instead.
    assert shape(tree) == {((1, 2, 3), False): {((4, 5, 6), True): {}}, ((9,), True): {}}


def test_insert_touches_only_the_attached_state():
    tree, *_ = make_tree()
    put(tree, [1, 2])
    put(tree, [9])
    put(tree, [1, 2, 3])  # passes through the state at 2, attaches at 3
    assert tree.evict_state(1) == 1
    assert shape(tree) == {((1, 2), False): {((3,), True): {}}, ((9,), True): {}}


def test_kv_eviction_follows_lru_of_leaves_and_lookup_refreshes():
    tree, kv_pool, _ = make_tree()
    put(tree, [1, 2])
    put(tree, [3, 4])
    put(tree, [5, 6])
    tree.match([1, 2])  # [1, 2] becomes newest; [3, 4] is now the oldest
    assert tree.evict_kv(2) == 2
    assert set(shape(tree)) == {((1, 2), True), ((5, 6), True)}
    assert tree.evict_kv(1) == 2  # whole leaf [5, 6]
    assert set(shape(tree)) == {((1, 2), True)}
    assert tree.evict_kv(10) == 2  # ran out: returns what it freed
    assert tree.num_nodes() == 0 and kv_pool.available() == kv_pool.size
    tree.check_integrity()


def test_insert_frees_duplicate_kv_and_keeps_tree_slots():
    tree, kv_pool, _ = make_tree()
    first = put(tree, [1, 2, 3, 4])
    tree_slots = as_list(tree.path_kv(first.node))
    kv = kv_pool.alloc(6)
    free_before = kv_pool.available()
    slot = tree.state_pool.alloc(1)[0]
    res = tree.insert([1, 2, 3, 4, 5, 6], kv, slot)
    assert res.existing_len == 4 and res.state_attached and res.inserted_len == 6
    assert kv_pool.available() == free_before + 4
    assert set(as_list(kv[:4])) <= set(kv_pool.free_slot_list())
    assert as_list(tree.path_kv(res.node)) == tree_slots + as_list(kv[4:])
    tree.check_integrity()


def test_insert_owned_prefix_is_not_freed_and_recomputed_part_is():
    tree, kv_pool, state_pool = make_tree()
    put(tree, [1, 2])
    put(tree, [1, 2, 3, 4])
    put(tree, [1, 2, 3, 4, 5])
    tree.evict_state(0)
    # A request resumes from [1, 2] (state at 2) although KV matches up to 5.
    m = tree.match([1, 2, 3, 4, 7, 8], limit=2)
    assert (m.kv_len, m.prefix_len) == (4, 2)
    tree.lock(m.node)
    tree.lock_state(m.node)
    own = kv_pool.alloc(4)  # recomputed 3, 4 and new 7, 8
    state = state_pool.alloc(1)[0]
    held = as_list(own)
    tree.check_integrity(held_kv=held, held_state=[state])
    free_before = kv_pool.available()
    kv = torch.cat([m.kv_slots, own])
    res = tree.insert([1, 2, 3, 4, 7, 8], kv, state, owned_from=m.prefix_len)
    assert res.existing_len == 4 and res.state_attached
    assert kv_pool.available() == free_before + 2  # only the recomputed duplicates
    tree.unlock_state(m.node)
    tree.unlock(m.node)
    tree.check_integrity()
    with pytest.raises(ValueError, match="owned_from"):
        tree.insert([5, 5], kv_pool.alloc(2), None, owned_from=2)


def test_state_already_exists_caller_keeps_slot():
    tree, _, state_pool = make_tree()
    put(tree, [1, 2, 3])
    kv = tree.kv_pool.alloc(3)
    slot = state_pool.alloc(1)[0]
    res = tree.insert([1, 2, 3], kv, slot)
    assert res.existing_len == 3 and not res.state_attached and res.node.state_slot != slot
    tree.check_integrity(held_state=[slot])  # still the caller's
    with pytest.raises(AssertionError):
        tree.check_integrity()  # without it the slot is leaked
    state_pool.free([slot])
    tree.check_integrity()


def test_tombstone_revival_on_insert():
    tree, *_ = make_tree()
    put(tree, [1, 2, 3, 4])
    put(tree, [1, 2, 5, 6])
    assert shape(tree) == {((1, 2), False): {((3, 4), True): {}, ((5, 6), True): {}}}
    assert tree.match([1, 2, 9]).prefix_len == 0
    res = put(tree, [1, 2])
    assert res.state_attached and res.existing_len == 2 and tree.num_nodes() == 3
    assert tree.match([1, 2, 9]).prefix_len == 2
    tree.check_integrity()


def test_insert_ending_mid_edge_splits_and_attaches():
    tree, *_ = make_tree()
    put(tree, seq(1, 6))
    res = put(tree, [1, 2, 3])
    assert res.existing_len == 3 and res.state_attached and res.node.depth == 3
    assert shape(tree) == {((1, 2, 3), True): {((4, 5, 6), True): {}}}
    tree.check_integrity()


def test_stateless_tail_is_not_inserted():
    tree, kv_pool, _ = make_tree()
    put(tree, [1, 2, 3])
    res = put(tree, [1, 2, 3, 4, 5], state=False)
    assert (res.existing_len, res.inserted_len, res.node.depth) == (3, 3, 3)
    assert shape(tree) == {((1, 2, 3), True): {}}
    res = put(tree, [7, 8], state=False)
    assert res.inserted_len == 0 and res.node is tree.root and tree.num_nodes() == 1
    assert kv_pool.available() == kv_pool.size - 3
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_cascade_deletion_through_tombstones(policy):
    tree, kv_pool, state_pool = make_tree(state_policy=policy)
    put(tree, [1, 2, 3])
    put(tree, [1, 2, 4])
    assert shape(tree) == {((1, 2), False): {((3,), True): {}, ((4,), True): {}}}
    assert tree.evict_state(1) == 1  # leaf [3] deleted with its KV
    assert shape(tree) == {((1, 2), False): {((4,), True): {}}}
    assert tree.evict_state(1) == 1  # leaf [4], then the childless tombstone [1, 2]
    assert tree.num_nodes() == 0 and tree.total_kv() == 0
    assert kv_pool.available() == kv_pool.size and state_pool.available() == state_pool.size
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_locked_entries_survive_eviction(policy):
    tree, kv_pool, state_pool = make_tree(state_policy=policy)
    put(tree, [1, 2])
    put(tree, [1, 2, 3, 4])
    put(tree, [5, 6])
    m = tree.match([1, 2, 3, 4, 9])
    assert m.prefix_len == 4
    tree.lock(m.node)
    tree.lock_state(m.node)
    assert tree.protected_kv() == 4 and tree.evictable_kv() == 2
    assert tree.protected_state() == 1 and tree.evictable_state() == 2
    assert tree.evict_kv(100) == 2
    assert tree.evict_state(100) == 1  # [1, 2] becomes a tombstone; [3, 4] is locked
    assert shape(tree) == {((1, 2), False): {((3, 4), True): {}}}
    tree.check_integrity()
    tree.unlock_state(m.node)
    tree.unlock(m.node)
    assert tree.evictable_kv() == 4 and tree.protected_kv() == 0
    assert tree.evict_kv(100) == 4
    assert kv_pool.available() == kv_pool.size and state_pool.available() == state_pool.size
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_kv_locked_leaf_losing_its_state_is_deleted_on_unlock(policy):
    tree, kv_pool, _ = make_tree(state_policy=policy)
    put(tree, [1, 2, 3])
    m = tree.match([1, 2, 3, 4])
    tree.lock(m.node)  # held, but its state is not state-locked (copy done)
    assert tree.evict_state(1) == 1
    assert shape(tree) == {((1, 2, 3), False): {}}  # transient locked tombstone leaf
    tree.check_integrity()
    assert tree.evict_kv(10) == 0
    tree.unlock(m.node)
    assert tree.num_nodes() == 0 and kv_pool.available() == kv_pool.size
    tree.check_integrity()


def test_unlock_counts_as_use_in_kv_lru():
    tree, *_ = make_tree()
    put(tree, [1])
    m = tree.match([1, 5])
    tree.lock(m.node)
    put(tree, [2])
    tree.unlock(m.node)  # [1] is now newer than [2]
    tree.evict_kv(1)
    assert set(shape(tree)) == {((1,), True)}


def test_lock_errors():
    tree, *_ = make_tree()
    res = put(tree, [1, 2])
    with pytest.raises(ValueError):
        tree.unlock(res.node)
    with pytest.raises(ValueError):
        tree.lock_state(res.node)  # not kv-locked
    with pytest.raises(ValueError):
        tree.unlock_state(res.node)
    tree.lock(tree.root)
    tree.unlock(tree.root)
    tree.lock_state(tree.root)  # root: no-ops
    tree.unlock_state(tree.root)
    tree.check_integrity()


def test_limit_excludes_state_beyond_it():
    tree, *_ = make_tree()
    put(tree, [1, 2, 3])
    put(tree, [1, 2, 3, 4, 5])
    assert tree.match([1, 2, 3], limit=2).prefix_len == 0
    assert tree.match([1, 2, 3], limit=3).prefix_len == 3
    assert tree.match([1, 2, 3]).prefix_len == 3
    m = tree.match([1, 2, 3, 4, 5], limit=4)
    assert (m.kv_len, m.prefix_len) == (5, 3)
    assert tree.match([1, 2, 3, 4, 5], limit=-1).prefix_len == 0
    assert tree.match([1, 2, 3, 4, 5], limit=99).prefix_len == 5


def test_empty_insert_and_lookup():
    tree, *_ = make_tree()
    res = tree.insert([], torch.empty(0, dtype=torch.long), 3)
    assert res.node is tree.root and not res.state_attached and res.existing_len == 0
    m = tree.match([])
    assert (m.kv_len, m.prefix_len, m.node) == (0, 0, tree.root)
    assert m.kv_slots.numel() == 0
    with pytest.raises(ValueError):
        tree.insert([1, 2], torch.zeros(3, dtype=torch.long))


def test_inserted_kv_is_copied_not_aliased():
    tree, kv_pool, _ = make_tree()
    row = torch.zeros(8, dtype=torch.long)
    row[:3] = kv_pool.alloc(3)
    slot = tree.state_pool.alloc(1)[0]
    res = tree.insert([1, 2, 3], row[:3], slot)
    expected = as_list(row[:3])
    row[:3] = -1  # the caller reuses its request row
    assert as_list(tree.path_kv(res.node)) == expected


def test_page_size_16_matches_whole_pages_only():
    ps = 16
    tree, kv_pool, _ = make_tree(kv_size=16 * ps, page_size=ps)
    a = [1] * 20 + [2] * 12  # two pages
    put(tree, a)
    m = tree.match(a + [3] * 5)
    assert (m.kv_len, m.prefix_len) == (32, 32)
    assert tree.match(a[:31]).kv_len == 16  # the second page is incomplete
    assert tree.match(a[:31]).prefix_len == 0
    b = a[:20] + [7] * 12  # diverges inside the second page
    m = tree.match(b)
    assert (m.kv_len, m.prefix_len) == (16, 0)
    put(tree, b)
    assert shape(tree) == {
        (tuple(a[:16]), False): {(tuple(a[16:]), True): {}, (tuple(b[16:]), True): {}}
    }
    slots = as_list(tree.match(b).kv_slots)
    assert all(slots[i] % ps == i % ps for i in range(32))
    spare = kv_pool.alloc(32)
    with pytest.raises(ValueError, match="page_size"):
        tree.insert([1] * 20, spare[:20])
    kv_pool.free(spare)
    tree.check_integrity()
    assert tree.evict_kv(1) == 16
    tree.evict_kv(100)
    assert kv_pool.available() == kv_pool.size
    tree.check_integrity()


def test_tree_page_size_must_fit_pool():
    _, kv_pool, state_pool = make_tree(kv_size=64, page_size=16)
    from mambaradix.cache.radix import RadixTree

    with pytest.raises(ValueError, match="page_size"):
        RadixTree(kv_pool, state_pool, page_size=8)
    with pytest.raises(ValueError, match="policy"):
        RadixTree(kv_pool, state_pool, page_size=16, state_policy="nope")


def test_cascade_stops_at_kv_locked_tombstone_until_unlock():
    tree, kv_pool, state_pool = make_tree()
    put(tree, [1, 2])
    m = tree.match([1, 2, 9])
    tree.lock(m.node)
    put(tree, [1, 2, 3])
    assert tree.evict_state(1) == 1  # [1, 2]: internal, so it becomes a tombstone
    assert shape(tree) == {((1, 2), False): {((3,), True): {}}}
    assert tree.evict_kv(1) == 1  # leaf [3]; the cascade stops at the locked [1, 2]
    assert shape(tree) == {((1, 2), False): {}} and tree.protected_kv() == 2
    tree.check_integrity()
    tree.unlock(m.node)
    assert tree.num_nodes() == 0
    assert kv_pool.available() == kv_pool.size and state_pool.available() == state_pool.size
    tree.check_integrity()


def test_tuple_tokens_match_like_lists():
    tree, *_ = make_tree()
    put(tree, [1, 2, 3])
    kv = tree.kv_pool.alloc(4)
    res = tree.insert((1, 2, 3, 4), kv, tree.state_pool.alloc(1)[0])
    assert res.existing_len == 3 and res.state_attached
    m = tree.match((1, 2, 3, 4, 5))
    assert (m.kv_len, m.prefix_len) == (4, 4)
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_pinned_states_go_last_and_never_for_optional_slots(policy):
    tree, *_ = make_tree(state_policy=policy)
    a, b, c = (put(tree, k).node for k in ([1, 2], [5, 6], [9, 8]))  # one depth: one value
    tree.pin_state(a)  # oldest, but a waiting request expects to resume from it
    tree.pin_state(a)
    tree.check_integrity()
    assert tree.evict_state(1) == 1 and b.state_slot is None  # the oldest unpinned went
    assert tree.evict_state(2, spare=SPARE_PINNED) == 1  # [9, 8]; the pinned one is spared
    assert a.state_slot is not None and c.state_slot is None
    assert tree.evict_state(1, spare=SPARE_PINNED) == 0
    tree.unpin_state(a)
    assert tree.evict_state(1, spare=SPARE_PINNED) == 0  # one pin left
    tree.unpin_state(a)  # back among the unpinned, as just used
    tree.check_integrity()
    assert tree.evict_state(1, spare=SPARE_PINNED) == 1 and a.state_slot is None
    with pytest.raises(ValueError, match="not pinned"):
        tree.unpin_state(a)


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_a_pinned_state_still_goes_when_nothing_else_can(policy):
    """A soft pin: eviction that may take pinned states takes them (least recently pinned
    first), and a pin on a node evicted meanwhile is released without touching the policy."""
    tree, *_ = make_tree(state_policy=policy)
    a, b = (put(tree, k).node for k in ([1, 2], [5, 6]))
    tree.pin_state(b)
    tree.pin_state(a)
    assert tree.evict_state(1) == 1 and b.state_slot is None  # pinned first, so oldest
    tree.unpin_state(b)  # deleted from the tree: only the count goes
    assert b.wait_pins == 0
    tree.check_integrity()
    put(tree, [5, 6])  # the same prefix again, unpinned now
    assert tree.evict_state(1) == 1 and shape(tree) == {((1, 2), True): {}}
    tree.unpin_state(a)
    tree.check_integrity()


def test_a_pinned_states_prefix_kv_goes_after_all_other_kv():
    """KV pressure takes the path of a pinned state (a waiting request's shared prefix) only
    after every other unlocked leaf, never when the caller spares pins, and frees it once the
    pin is released or the state itself is evicted."""
    tree, kv_pool, _ = make_tree()
    a = put(tree, [1, 2, 3, 4]).node  # oldest
    put(tree, [1, 2, 7, 8])  # splits: [1 2] becomes a tombstone above a and this one
    c = put(tree, [9, 9]).node
    tree.pin_state(a)
    tree.check_integrity()
    assert {link.owner.depth for link in tree.kv_pinned.iter_oldest_first(9)} == {2, 4}
    assert tree.evict_kv(4, spare=SPARE_PINNED) == 4  # [7 8] then [9 9]; a's path spared
    assert c.parent is None and shape(tree) == {((1, 2), False): {((3, 4), True): {}}}
    assert tree.evict_kv(1, spare=SPARE_PINNED) == 0
    tree.check_integrity()
    tree.unpin_state(a)  # back in the plain list
    assert len(tree.kv_pinned) == 0
    tree.check_integrity()
    tree.pin_state(a)
    assert tree.evict_kv(1) == 4  # nothing else left: a soft pin goes (with its tombstone)
    assert tree.num_nodes() == 0 and kv_pool.available() == kv_pool.size
    tree.unpin_state(a)
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_a_pin_protects_kv_only_while_its_state_is_there(policy):
    """The state of a pinned node evicted (a tombstone kept by its children): its path's KV is
    unpinned at once, so the tombstone's prefix goes by age again; a state attached there later
    restores the protection while the pin lasts."""
    tree, *_ = make_tree(state_policy=policy)
    a = put(tree, [1, 2]).node
    b = put(tree, [1, 2, 3, 4]).node
    tree.lock(b)  # a request resuming from b: a is kept as b's parent
    tree.lock_state(b)
    tree.pin_state(a)
    assert (a.path_pins, b.path_pins) == (1, 0)
    assert tree.evict_state(1) == 1 and a.state_slot is None  # the only evictable state
    assert a.path_pins == 0
    tree.check_integrity()
    put(tree, [1, 2])  # a snapshot there again: the waiting request's pin counts once more
    assert a.state_slot is not None and a.path_pins == 1
    tree.unlock_state(b)
    tree.unlock(b)
    assert a.kv_link.home is tree.kv_pinned and b.kv_link.home is tree.kv_lru
    tree.check_integrity()
    assert tree.evict_kv(1, spare=SPARE_PINNED) == 2 and b.parent is None
    assert a.parent is not None
    tree.unpin_state(a)
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_a_pin_out_of_step_with_the_policy_is_caught(policy):
    """Negative control: a count changed behind the tree's back leaves the node in the wrong
    tier, and the integrity check names it."""
    from mambaradix.cache.integrity import IntegrityError

    tree, *_ = make_tree(state_policy=policy)
    a = put(tree, [1, 2]).node
    a.wait_pins = 1
    tree._pin_path(a, 1)  # (the KV side kept in step: only the state policy's tier is wrong)
    with pytest.raises(IntegrityError, match="tier does not match the node's pins"):
        tree.check_integrity()
    a.wait_pins = 0
    tree._pin_path(a, -1)
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_branch_points_go_after_the_other_states(policy):
    """A node that has had two children (or that the planner marks) is a branch point: its
    state goes after every other unpinned state, and never for an optional slot; it stays one
    when its children are evicted."""
    tree, *_ = make_tree(state_size=16, state_policy=policy)
    put(tree, [1, 2, 3])
    shared = put(tree, [1, 2]).node  # splits: [1, 2] with one child
    assert not shared.branched
    put(tree, [1, 2, 7])  # a second child
    assert shared.branched
    lone = put(tree, [9]).node
    tree.check_integrity()
    assert tree.evict_state(3, spare=SPARE_SHARED) == 3  # [3], [7], [9]: the branch point stays
    assert shared.state_slot is not None and lone.parent is None
    assert shared.branched and not shared.children  # its children went: still a branch point
    assert tree.evict_state(1, spare=SPARE_SHARED) == 0
    assert tree.evict_state(1, spare=SPARE_PINNED) == 1 and shared.parent is None
    tree.check_integrity()


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_the_planners_branch_points_and_the_tiers_cap(policy):
    """``mark_branch`` makes a state a branch point without a second child; once branch points
    hold more than half the pool the oldest of them goes first, even for an optional slot."""
    tree, *_ = make_tree(state_size=6, state_policy=policy)
    nodes = [put(tree, [k]).node for k in (1, 2, 3, 4)]
    other = put(tree, [5]).node
    for node in nodes:
        tree.mark_branch(node)
    tree.check_integrity()
    assert tree.policy.branch_cap == 3
    assert tree.evict_state(1, spare=SPARE_SHARED) == 1 and nodes[0].parent is None  # over cap
    assert tree.evict_state(1, spare=SPARE_SHARED) == 1 and other.parent is None
    assert tree.evict_state(1, spare=SPARE_SHARED) == 0  # three branch points: within the cap
    assert all(n.state_slot is not None for n in nodes[1:])


@pytest.mark.parametrize("policy", STATE_POLICIES)
def test_a_branch_mark_out_of_step_with_the_policy_is_caught(policy):
    """Negative control: a node marked a branch point behind the tree's back stays in the wrong
    tier, and the integrity check names it."""
    from mambaradix.cache.integrity import IntegrityError

    tree, *_ = make_tree(state_policy=policy)
    a = put(tree, [1, 2]).node
    a.branched = True
    with pytest.raises(IntegrityError, match="tier does not match"):
        tree.check_integrity()
