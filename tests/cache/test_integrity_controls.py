"""Negative controls for every check of the radix tree's integrity check (the request cache's:
test_integrity_controls_request.py; the cases' parts: integrity_env.py).

Each case builds a small healthy tree over the real pools, shows that ``check_integrity`` passes
(positive control), corrupts exactly one thing the way a real bug would, and asserts that the
check meant for it fires: the message is matched, so a case proves its own check works, not
just that some other check happens to trip. ``CHECKS`` lists every ``_fail`` site of
``cache/integrity.py`` (plus the messages of ``LRUList.check_links`` and the state policy's
``check``); ``test_every_check_has_a_control`` keeps that list and the cases in step, so a
check added later without a control fails here.

Reachability notes (ordering), repeated at the cases they concern:
- a node under two parents trips "parent link is wrong" first (the copy under the wrong parent
  is visited before the right one); "reachable twice" is reached by a cycle or by one node
  stored under two keys of the same parent;
- with intact links a list cannot hold one link twice, and a length that disagrees with the
  links trips ``check_links`` first; so "holds a node twice" needs two link objects owned by one
  node, and the length half of the "holds N nodes (length L)" checks needs a length off by
  whole laps of the circular list (``2 * N + 1``), which ``check_links`` walks without noticing;
- ``_check_slots``' "free + tree + held != pool size" with every slot counted once is
  impossible (the counts sum to the total once every slot is in range), so its ``slot -1``
  branch is dead; every reachable case names a slot.

Each check was also shown to be the one its cases depend on: with any single ``_fail`` site
(or forwarded message) disabled, all of its cases fail (a one-off mutation run, not part of
the suite).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from integrity_env import (
    CHECKS,
    Case,
    _add,
    _add_len,
    _detached,
    _double_free_kv,
    _empty_edge,
    _env,
    _forget_prv,
    _lap_length,
    _leaf,
    _leaf2,
    _lock_keeping_in_kv_lru,
    _lock_state_keeping_in_policy,
    _lose_locked_state,
    _parent_lock_lost,
    _pin_left_in_kv_lru,
    _pin_lost_on_ancestor,
    _rekey,
    _root,
    _second_link,
    _set,
    _stale_entry,
    _swap_heap_ends,
    _tombstone_leaf,
    _touch_without_ancestors,
    _unlock_before_unlock_state,
)
from test_radix_helpers import seq

from mambaradix.cache import integrity
from mambaradix.cache.integrity import IntegrityError

_E = r".*key=\[10, 11, 12\]"

CASES: list[Case] = [
    # ---- the root: each condition of the two compound root checks separately
    Case("root_has_parent", _set(_root, "parent", _leaf), "root_empty"),
    Case("root_has_key", _set(_root, "key", lambda e: [1]), "root_empty"),
    Case("root_has_depth", _set(_root, "depth", lambda e: 1), "root_empty"),
    Case(
        "root_has_state",
        _set(_root, "state_slot", lambda e: e.state_pool.alloc(1)[0]),
        "root_empty",
    ),
    Case("root_unlocked", _set(_root, "kv_lock", lambda e: 0), "root_locked_once"),
    Case("root_locked_twice", _set(_root, "kv_lock", lambda e: 2), "root_locked_once"),
    Case("root_state_locked", _set(_root, "state_lock", lambda e: 1), "root_locked_once"),
    Case(
        "root_in_kv_lru",
        lambda e: e.tree.kv_lru.push_newest(e.tree.root.kv_link, e.tick()),
        "root_not_listed",
    ),
    Case(
        "root_in_state_policy",
        lambda e: e.tree.policy.add(e.tree.root, e.tick()),
        "root_not_listed",
    ),
    # ---- structure
    # A node under two parents is reported as a wrong parent link (the copy under the wrong
    # parent is visited first); "reachable twice" is reached by a cycle back to an ancestor or
    # by one node stored under two keys of one parent.
    Case(
        "cycle_to_ancestor",
        lambda e: e.at(*seq(1, 7)).children.__setitem__(1, e.at(1, 2, 3)),
        "reachable_twice",
        r"node reachable twice .*key=\[1, 2, 3\]",
    ),
    Case(
        "child_under_two_keys",
        lambda e: e.tree.root.children.__setitem__(99, _leaf(e)),
        "reachable_twice",
        r"node reachable twice" + _E,
    ),
    Case(
        "wrong_parent_link",
        _set(lambda e: e.at(*seq(1, 7)), "parent", lambda e: e.at(1, 2, 3)),
        "parent_link",
        r"child's parent link is wrong: .*key=\[6, 7\]",
    ),
    Case(
        "child_under_two_parents",
        lambda e: _leaf(e).children.__setitem__(6, e.at(*seq(1, 7))),
        "parent_link",
        r"child's parent link is wrong: .*key=\[6, 7\]",
    ),
    Case("empty_edge", _empty_edge, "edge_length", r"edge length 0 .* page_size 1"),
    Case(
        "edge_not_page_multiple",
        lambda e: _leaf2(e).key.pop(),
        "edge_length",
        r"edge length 3 .* page_size 2",
        page=2,
    ),
    Case("child_key_mismatch", _rekey(10, 99), "child_key", r"child stored under key 99 "),
    Case(
        "child_page_key_mismatch",
        _rekey((10, 11), (10, 99)),
        "child_key",
        r"child stored under key \(10, 99\) ",
        page=2,
    ),
    Case(
        "kv_wrong_dtype",
        _set(_leaf, "kv", lambda e: _leaf(e).kv.int()),
        "kv_tensor",
        r"kv must be a 1-D long tensor of 3 slots",
    ),
    Case(
        "kv_too_short",
        _set(_leaf, "kv", lambda e: _leaf(e).kv[:2]),
        "kv_tensor",
        r"kv must be a 1-D long tensor of 3 slots",
    ),
    Case(
        "kv_two_dims",
        _set(_leaf, "kv", lambda e: _leaf(e).kv.view(1, 3)),
        "kv_tensor",
        r"kv must be a 1-D long tensor of 3 slots",
    ),
    # A page starting at an odd slot; then an aligned first slot with its pair from elsewhere.
    Case(
        "kv_page_misaligned",
        _set(_leaf2, "kv", lambda e: _leaf2(e).kv[[1, 0, 2, 3]]),
        "kv_pages",
        r"not whole pages of 2",
        page=2,
    ),
    Case(
        "kv_page_mixed",
        _set(_leaf2, "kv", lambda e: _leaf2(e).kv[[0, 3, 2, 1]]),
        "kv_pages",
        r"not whole pages of 2",
        page=2,
    ),
    Case(
        "wrong_depth", _set(_leaf, "depth", lambda e: 4), "depth", r"depth 4 != parent depth 0 \+ 3"
    ),
    # ---- locks
    Case("negative_kv_lock", _set(_leaf, "kv_lock", lambda e: -1), "negative_lock"),
    Case("negative_state_lock", _set(_leaf, "state_lock", lambda e: -1), "negative_lock"),
    Case(
        "unlock_before_unlock_state",
        _unlock_before_unlock_state,
        "kv_lock_below_state_lock",
        r"kv_lock < state_lock" + _E,
    ),
    Case(
        "locked_state_evicted",
        _lose_locked_state,
        "state_lock_without_state",
        r"lost its state" + _E,
    ),
    Case("tombstone_leaf", _tombstone_leaf, "tombstone_leaf", r"tombstone leaf" + _E),
    Case(
        "stored_tombstone",
        lambda e: setattr(e.at(1, 2, 3, 4, 5), "stored", True),  # B: a tombstone
        "stored_without_state",
        r"node marked stored without a state in RAM",
    ),
    Case(
        "parent_lock_lost",
        _parent_lock_lost,
        "children_locks",
        r"kv_lock 0 < sum of children's kv_lock 1: .*key=\[4, 5\]",
    ),
    # ---- the KV-LRU (5 unlocked nodes)
    Case(
        "kv_lru_half_removed",
        lambda e: _forget_prv(e.tree.kv_lru, _leaf(e).kv_link),
        "kv_lru_links",
    ),
    Case(
        "kv_lru_length_short",
        lambda e: _add_len(e.tree.kv_lru, -1),
        "kv_lru_links_length",
        r"more entries than its length 4$",
    ),
    # The message says "more entries" when the list holds fewer: the wording is only loose.
    Case(
        "kv_lru_length_long",
        lambda e: _add_len(e.tree.kv_lru, 1),
        "kv_lru_links_length",
        r"more entries than its length 6$",
    ),
    Case(
        "kv_lru_deleted_node",
        lambda e: e.tree.kv_lru.push_newest(_detached().kv_link, e.tick()),
        "kv_lru_foreign",
        r"not in the tree: .*key=\[77\]",
    ),
    # Two link objects owned by one node: with intact links the only way a node occurs twice.
    Case(
        "kv_lru_node_twice",
        lambda e: _second_link(e.tree.kv_lru, _leaf(e), "kv_link", e.tick()),
        "kv_lru_twice",
        r"twice" + _E,
    ),
    Case("kv_lru_locked_node", _lock_keeping_in_kv_lru, "kv_lru_locked", r"locked node" + _E),
    # ---- pinned paths: the pins' sums and the two KV lists
    Case(
        "path_pins_on_the_node",
        lambda e: _add(_leaf(e), "path_pins", 1),
        "path_pins",
        r"path_pins 1 != the pins of the states on its path 0",
    ),
    Case(
        "path_pins_lost_on_an_ancestor",
        _pin_lost_on_ancestor,
        "path_pins",
        r"path_pins 0 != the pins of the states on its path 1: .*key=\[4, 5\]",
    ),
    Case("pinned_node_in_kv_lru", _pin_left_in_kv_lru, "kv_list_pins", r"path pins" + _E),
    Case(
        "kv_lru_out_of_order",
        _set(lambda e: e.tree.kv_lru.oldest(), "tick", lambda e: 10**9),
        "kv_lru_order",
        r"tick \d+ after 1000000000",
    ),
    Case(
        "kv_lru_missing_unlocked",
        lambda e: e.tree.kv_lru.remove(_leaf(e).kv_link),
        "kv_lru_members",
        r"holds 4 nodes \(length 4\), expected every unlocked non-root node: 5",
    ),
    Case(
        "kv_lru_lapped_length",
        lambda e: _lap_length(e.tree.kv_lru),
        "kv_lru_members",
        r"holds 5 nodes \(length 11\)",
    ),
    Case(
        "touch_without_ancestors",
        _touch_without_ancestors,
        "kv_lru_parent_older",
        r"older than its child in the KV-LRU: .*key=\[4, 5\]",
    ),
    # ---- the state policy (4 unlocked states)
    Case(
        "policy_half_removed",
        lambda e: _forget_prv(e.tree.policy.lru, _leaf(e).st_link),
        "policy_links",
    ),
    Case(
        "policy_length_short",
        lambda e: _add_len(e.tree.policy.lru, -1),
        "policy_links_length",
        r"more entries than its length 3$",
    ),
    Case(
        "policy_out_of_order",
        _set(lambda e: e.tree.policy.lru.oldest(), "tick", lambda e: 10**9),
        "policy_order",
        r"\(tick \d+ after 1000000000\)",
    ),
    Case(
        "policy_deleted_node",
        lambda e: e.tree.policy.add(_detached(), e.tick()),
        "policy_foreign",
        r"not in the tree: .*key=\[77\]",
    ),
    Case(
        "policy_node_twice",
        lambda e: _second_link(e.tree.policy.lru, _leaf(e), "st_link", e.tick()),
        "policy_twice",
        r"twice" + _E,
    ),
    Case(
        "policy_holds_tombstone",
        lambda e: e.tree.policy.add(e.at(*seq(1, 5)), e.tick()),
        "policy_stateless_or_locked",
        r"without an unlocked state: .*key=\[4, 5\]",
    ),
    Case(
        "policy_holds_locked_state",
        _lock_state_keeping_in_policy,
        "policy_stateless_or_locked",
        r"without an unlocked state" + _E,
    ),
    Case(
        "policy_missing_state",
        lambda e: e.tree.policy.remove(_leaf(e)),
        "policy_members",
        r"holds 3 nodes \(length 3\), expected every node with an unlocked state: 4",
    ),
    Case(
        "policy_lapped_length",
        lambda e: _lap_length(e.tree.policy.lru),
        "policy_members",
        r"holds 4 nodes \(length 9\)",
    ),
    # ---- the value state policy (4 unlocked states, all in its first tier: priorities 0 (A: it
    # has a child), 7, 7, 3 at clock 0); the checks the tree makes of any policy, through it too
    Case("value_heap_swapped", _swap_heap_ends, "value_order", policy="value"),
    Case("value_stale_entry", _stale_entry, "value_entry", _E, policy="value"),
    Case(
        "value_branch_behind_its_back",
        _set(_leaf, "branched", lambda e: True),
        "value_tier",
        _E,
        policy="value",
    ),
    Case(
        "value_priority_ahead_of_the_clock",
        lambda e: e.tree.policy.tiers[0].top().__setitem__(4, 10**9),
        "value_priority",
        policy="value",
    ),
    Case(
        "value_priority_not_refreshed",
        lambda e: e.tree.policy.tiers[0].top().__setitem__(0, e.tree.policy.tiers[0].top()[0] + 1),
        "value_step",
        policy="value",
    ),
    Case(
        "value_live_count_high",
        lambda e: setattr(e.tree.policy.tiers[0], "live", 5),
        "value_live",
        r"holds 4 live entries, its count says 5$",
        policy="value",
    ),
    Case(
        "value_deleted_node",
        lambda e: e.tree.policy.add(_detached(), e.tick()),
        "policy_foreign",
        r"not in the tree: .*key=\[77\]",
        policy="value",
    ),
    Case(
        "value_holds_tombstone",
        lambda e: e.tree.policy.add(e.at(*seq(1, 5)), e.tick()),
        "policy_stateless_or_locked",
        r"without an unlocked state: .*key=\[4, 5\]",
        policy="value",
    ),
    Case(
        "value_missing_state",
        lambda e: e.tree.policy.remove(_leaf(e)),
        "policy_members",
        r"holds 3 nodes \(length 3\), expected every node with an unlocked state: 4",
        policy="value",
    ),
    # ---- counters (12 evictable KV tokens, 4 evictable states, 5 nodes)
    *[
        Case(
            f"counter_{name}_{d:+d}",
            lambda e, n=name, d=d: _add(e.tree, f"_{n}", d),
            "counter",
            rf"counter {name} is {value + d}, recomputed {value}",
        )
        for name, value in (
            ("evictable_kv", 12),
            ("protected_kv", 0),
            ("evictable_state", 4),
            ("protected_state", 0),
        )
        for d in (1, -1)
    ],
    Case(
        "num_nodes_high",
        lambda e: _add(e.tree, "_num_nodes", 1),
        "num_nodes",
        r"num_nodes\(\) is 6, the tree has 5",
    ),
    Case(
        "num_nodes_low",
        lambda e: _add(e.tree, "_num_nodes", -1),
        "num_nodes",
        r"num_nodes\(\) is 4, the tree has 5",
    ),
    # ---- slots (KV pool 256, state pool 16)
    Case(
        "kv_slot_past_pool",
        lambda e: _leaf(e).kv.__setitem__(0, 256),
        "slot_range",
        r"^KV slot out of range \[0, 256\) in tree",
    ),
    Case(
        "kv_slot_negative",
        lambda e: _leaf(e).kv.__setitem__(0, -1),
        "slot_range",
        r"^KV slot out of range \[0, 256\) in tree",
    ),
    Case(
        "held_kv_slot_past_pool",
        lambda e: dict(held_kv=[256]),
        "slot_range",
        r"^KV slot out of range \[0, 256\) in held",
    ),
    Case(
        "state_slot_past_pool",
        _set(_leaf, "state_slot", lambda e: 16),
        "slot_range",
        r"^state slot out of range \[0, 16\) in tree",
    ),
    Case(
        "held_state_slot_negative",
        lambda e: dict(held_state=[-1]),
        "slot_range",
        r"^state slot out of range \[0, 16\) in held",
    ),
    # Slot 14: the top of the free stack (the last insert freed its duplicate KV 10..14).
    Case(
        "kv_slot_leaked",
        lambda e: e.kv_pool.alloc(1),
        "slot_once",
        r"^KV slot 14 is leaked \(in no place\) \(free: 0, tree: 0, held: 0\)",
    ),
    Case(
        "kv_page_leaked",
        lambda e: e.kv_pool.alloc(2),
        "slot_once",
        r"^KV slot 12 is leaked",
        page=2,
    ),
    Case(
        "kv_slot_freed_while_in_tree",
        lambda e: e.kv_pool.free(_leaf(e).kv[:1].clone()),
        "slot_once",
        r"^KV slot \d+ is duplicated \(free: 1, tree: 1, held: 0\)",
    ),
    Case(
        "kv_slot_double_freed",
        _double_free_kv,
        "slot_once",
        r"^KV slot \d+ is duplicated \(free: 2, tree: 0, held: 0\)",
    ),
    Case(
        "held_kv_slot_in_tree",
        lambda e: dict(held_kv=_leaf(e).kv[:1].tolist()),
        "slot_once",
        r"^KV slot \d+ is duplicated \(free: 0, tree: 1, held: 1\)",
    ),
    Case(
        "state_slot_leaked",
        lambda e: e.state_pool.alloc(1),
        "slot_once",
        r"^state slot 4 is leaked \(in no place\)",
    ),
    Case(
        "state_slot_freed_while_in_tree",
        lambda e: e.state_pool.free([_leaf(e).state_slot]),
        "slot_once",
        r"^state slot \d+ is duplicated \(free: 1, tree: 1, held: 0\)",
    ),
    Case(
        "held_state_slot_in_tree",
        lambda e: dict(held_state=[_leaf(e).state_slot]),
        "slot_once",
        r"^state slot \d+ is duplicated \(free: 0, tree: 1, held: 1\)",
    ),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_corruption_fires_its_check(case: Case):
    env = _env(case.page, case.policy)
    result = case.corrupt(env)
    kwargs = result if isinstance(result, dict) else {}
    with pytest.raises(IntegrityError, match=case.pattern or CHECKS[case.check]) as err:
        env.tree.check_integrity(**kwargs)
    fired = [name for name, regex in CHECKS.items() if re.search(regex, str(err.value))]
    assert fired == [case.check], f"expected {case.check} to fire, got {fired}: {err.value}"


def test_every_check_has_a_control():
    """Every check of integrity.py (its `_fail` sites, counted from the source) is in CHECKS,
    and every entry of CHECKS has at least one case."""
    source = Path(integrity.__file__).read_text()
    fail_sites = source.count("_fail(") - 1  # minus the definition
    # Two sites forward messages: the KV-LRU's check_links (2 messages) and the state policy's
    # check (lru: its lists' 2 and its order check; value: 6); every other site has one entry.
    assert len(CHECKS) == fail_sites - 2 + 2 + 3 + 6, "a check was added or removed: update CHECKS"
    assert {c.check for c in CASES} == set(CHECKS)
    assert len({c.name for c in CASES}) == len(CASES)
