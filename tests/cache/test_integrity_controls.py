"""Negative controls for every check of the radix tree's and the request cache's integrity checks.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from test_radix_helpers import make_tree, put, seq

from mambaradix.cache import integrity
from mambaradix.cache.integrity import IntegrityError
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.lru import LRULink, LRUList
from mambaradix.cache.radix import RadixTree, TreeNode
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.request_cache import RequestCache
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec

# ---------------------------------------------------------------------------- the checks

# Every check of cache/integrity.py (one per `_fail` site, in source order) and the messages it
# forwards from the LRU list and the state policy. Each must be matched by at least one case.
CHECKS = {
    "root_empty": r"root must be the permanent empty prefix",
    "root_locked_once": r"root must stay locked exactly once",
    "root_not_listed": r"root must not be in an LRU list",
    "reachable_twice": r"node reachable twice",
    "parent_link": r"child's parent link is wrong",
    "edge_length": r"edge length \d+ is not a positive multiple of page_size",
    "child_key": r"child stored under key .* but its edge starts differently",
    "kv_tensor": r"kv must be a 1-D long tensor of \d+ slots",
    "kv_pages": r"kv slots are not whole pages of \d+",
    "depth": r"depth \d+ != parent depth \d+ \+ \d+",
    "negative_lock": r"negative lock count",
    "kv_lock_below_state_lock": r"kv_lock < state_lock",
    "state_lock_without_state": r"state-locked node lost its state",
    "tombstone_leaf": r"tombstone leaf",
    "children_locks": r"kv_lock \d+ < sum of children's kv_lock \d+",
    "kv_lru_links": r"^KV LRU list has a broken link",
    "kv_lru_links_length": r"^KV LRU list holds more entries than its length",
    "kv_lru_foreign": r"KV-LRU holds a node that is not in the tree",
    "kv_lru_twice": r"KV-LRU holds a node twice",
    "kv_lru_locked": r"KV-LRU holds a locked node",
    "kv_lru_order": r"KV-LRU out of access order",
    "kv_lru_members": r"KV-LRU holds \d+ nodes \(length \d+\), expected every unlocked",
    "kv_lru_parent_older": r"unlocked parent older than its child in the KV-LRU",
    "policy_links": r"^state LRU list has a broken link",
    "policy_links_length": r"^state LRU list holds more entries than its length",
    "policy_order": r"^state LRU out of access order",
    "policy_foreign": r"state policy holds a node that is not in the tree",
    "policy_twice": r"state policy holds a node twice",
    "policy_stateless_or_locked": r"state policy holds a node without an unlocked state",
    "policy_members": r"state policy holds \d+ nodes \(length \d+\), expected every node",
    "counter": r"counter \w+ is -?\d+, recomputed \d+",
    "num_nodes": r"num_nodes\(\) is -?\d+, the tree has \d+",
    "slot_range": r"slot out of range \[0, \d+\) in \w+",
    "slot_once": r"slot \d+ is (leaked \(in no place\)|duplicated)",
}


# ---------------------------------------------------------------------------- fixtures


@dataclass
class Env:
    tree: RadixTree
    kv_pool: KVPool
    state_pool: StatePool

    def at(self, *tokens: int) -> TreeNode:
        """The node whose path spells exactly ``tokens`` (tombstones included)."""
        node, pos = self.tree.root, 0
        while pos < len(tokens):
            node = node.children[self.tree._child_key(list(tokens), pos)]
            pos += len(node.key)
        assert pos == len(tokens), f"no node ends at {tokens}"
        return node

    def tick(self) -> int:
        self.tree._tick += 1
        return self.tree._tick


def _env(page_size: int = 1) -> Env:
    """page 1::

        root ── A [1 2 3]* ── B [4 5] ──┬── C [6 7]*
           │                            └── D [60 70]*
           └── E [10 11 12]*

    page 2 (KV pool pages of 2 too)::

        root ── [1 2]* ── [3 4] ──┬── [5 6]*
           │                      └── [50 60]*
           └── [10 11 12 13]*
    """
    tree, kv_pool, state_pool = make_tree(page_size=page_size)
    if page_size == 1:
        seqs = ([1, 2, 3], seq(1, 7), [10, 11, 12], [1, 2, 3, 4, 5, 60, 70])
    else:
        seqs = ([1, 2], seq(1, 6), seq(10, 13), [1, 2, 3, 4, 50, 60])
    for tokens in seqs:
        put(tree, tokens)
    tree.check_integrity()  # positive control: the healthy tree passes
    return Env(tree, kv_pool, state_pool)


def _detached() -> TreeNode:
    """A node that is not (or no longer) in the tree, e.g. one deleted by an eviction."""
    return TreeNode(key=[77], kv=torch.tensor([0]), state_slot=None, parent=None, depth=1)


def _forget_prv(lst: LRUList, link: LRULink) -> None:
    """A broken ``remove``: unlinks forward only, the next entry still points back at it."""
    link.prv.nxt = link.nxt
    lst._len -= 1
    link.prv = link.nxt = None


def _second_link(lru: LRUList, node: TreeNode, attr: str, tick: int) -> None:
    """A node's link replaced while the old one stays listed, then the new one listed too."""
    new = LRULink(node)
    setattr(node, attr, new)
    lru.push_newest(new, tick)


def _lock_state_keeping_in_policy(env: Env) -> None:
    """A broken ``lock_state``: counts the lock but leaves the state in the policy."""
    leaf = env.at(10, 11, 12)
    env.tree.lock(leaf)
    leaf.state_lock += 1
    env.tree._evictable_state -= 1
    env.tree._protected_state += 1


def _lock_keeping_in_kv_lru(env: Env) -> None:
    """A broken ``lock``: counts the lock but leaves the node in the KV-LRU."""
    leaf = env.at(10, 11, 12)
    leaf.kv_lock += 1
    env.tree._evictable_kv -= 3
    env.tree._protected_kv += 3


def _lap_length(lru: LRUList) -> None:
    """A length off by a whole lap of the circular list (N + 1 links with the sentinel): the
    only wrong length check_links walks through without noticing, so it reaches the length half
    of the "holds N nodes (length L)" checks (any other wrong length trips check_links first)."""
    lru._len = 2 * lru._len + 1


def _add_len(lru: LRUList, d: int) -> None:
    lru._len += d


def _add(obj: object, attr: str, d: int) -> None:
    setattr(obj, attr, getattr(obj, attr) + d)


def _lose_locked_state(env: Env) -> None:
    """A state freed (e.g. evicted) while a request had it state-locked."""
    leaf = env.at(10, 11, 12)
    env.tree.lock(leaf)
    env.tree.lock_state(leaf)
    env.tree.check_integrity()
    env.state_pool.free([leaf.state_slot])
    leaf.state_slot = None
    env.tree._protected_state -= 1


def _unlock_before_unlock_state(env: Env) -> None:
    """A request releasing its KV lock while it still holds the state lock (real API calls)."""
    leaf = env.at(10, 11, 12)
    env.tree.lock(leaf)
    env.tree.lock_state(leaf)
    env.tree.check_integrity()
    env.tree.unlock(leaf)


def _tombstone_leaf(env: Env) -> None:
    """A state evicted from an unlocked leaf without deleting the leaf."""
    leaf = env.at(10, 11, 12)
    env.tree.policy.remove(leaf)
    env.state_pool.free([leaf.state_slot])
    leaf.state_slot = None
    env.tree._evictable_state -= 1  # everything else consistent: only the tombstone is wrong


def _parent_lock_lost(env: Env) -> None:
    """A lock that reached the leaf but was dropped on an ancestor."""
    env.tree.lock(env.at(*seq(1, 7)))
    env.tree.check_integrity()
    env.at(1, 2, 3, 4, 5).kv_lock -= 1


def _touch_without_ancestors(env: Env) -> None:
    """A match that touches the node it returns but not the path above it."""
    env.tree.kv_lru.touch(env.at(*seq(1, 7)).kv_link, env.tick())


def _double_free_kv(env: Env) -> None:
    """A free slot returned to the pool a second time."""
    free = env.kv_pool.free_slot_list()[0]
    env.kv_pool.free(torch.tensor([free]))


class Case(NamedTuple):
    """``corrupt(env)`` breaks one thing (it may return ``check_integrity`` kwargs); ``check``
    must be the one check that fires, with a message matching ``pattern`` (default: the
    check's own regex); ``page``: page size of the tree and its KV pool."""

    name: str
    corrupt: Callable[[Env], object]
    check: str
    pattern: str | None = None
    page: int = 1


def _set(path: Callable[[Env], object], attr: str, value: Callable[[Env], object]):
    return lambda e: setattr(path(e), attr, value(e))


def _root(e: Env) -> TreeNode:
    return e.tree.root


def _leaf(e: Env) -> TreeNode:  # E [10 11 12], a leaf under the root
    return e.at(10, 11, 12)


def _leaf2(e: Env) -> TreeNode:  # [10 11 12 13] of the page-2 tree
    return e.at(*seq(10, 13))


def _empty_edge(e: Env) -> None:
    """A split that leaves an empty lower half."""
    c = e.at(*seq(1, 7))
    c.children[8] = TreeNode(
        key=[], kv=torch.empty(0, dtype=torch.long), state_slot=None, parent=c, depth=7
    )


def _rekey(old: object, new: object) -> Callable[[Env], None]:
    """A node kept under a stale key (e.g. a split that re-keys the wrong half)."""
    return lambda e: e.tree.root.children.__setitem__(new, e.tree.root.children.pop(old))


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
    env = _env(case.page)
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
    # check (3: its LRU's 2 and its order check); every other site has one entry.
    assert len(CHECKS) == fail_sites - 2 + 2 + 3, "a check was added or removed: update CHECKS"
    assert {c.check for c in CASES} == set(CHECKS)
    assert len({c.name for c in CASES}) == len(CASES)


# ---------------------------------------------------------------------------- request cache

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
