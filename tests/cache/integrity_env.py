"""The tree-integrity controls' parts (test_integrity_controls.py): ``CHECKS`` (every check of
``cache/integrity.py`` by name, with the message it raises), the small healthy tree the cases
corrupt (``Env``), the corruption helpers and the ``Case`` record."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from test_radix_helpers import make_tree, put, seq

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.lru import LRULink, LRUList
from mambaradix.cache.radix import RadixTree, TreeNode
from mambaradix.cache.state_pool import StatePool

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
    "stored_without_state": r"node marked stored without a state in RAM",
    "tombstone_leaf": r"tombstone leaf",
    "children_locks": r"kv_lock \d+ < sum of children's kv_lock \d+",
    "path_pins": r"path_pins -?\d+ != the pins of the states on its path \d+",
    "kv_lru_links": r"^KV LRU list has a broken link",
    "kv_lru_links_length": r"^KV LRU list holds more entries than its length",
    "kv_lru_foreign": r"KV-LRU holds a node that is not in the tree",
    "kv_lru_twice": r"KV-LRU holds a node twice",
    "kv_lru_locked": r"KV-LRU holds a locked node",
    "kv_list_pins": r"KV-LRU list does not match the node's path pins",
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
    "value_order": r"^state value heap out of order",
    "value_entry": r"^state value heap entry is not the node's own",
    "value_tier": r"^state value tier does not match the node's pins or children",
    "value_priority": r"^state priority based on a clock ahead of the policy's",
    "value_step": r"^state priority out of step with the node's children",
    "value_live": r"^state value heap holds \d+ live entries, its count says \d+",
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


def _env(page_size: int = 1, policy: str = "lru") -> Env:
    """page 1::

        root ── A [1 2 3]* ── B [4 5] ──┬── C [6 7]*
           │                            └── D [60 70]*
           └── E [10 11 12]*

    page 2 (KV pool pages of 2 too)::

        root ── [1 2]* ── [3 4] ──┬── [5 6]*
           │                      └── [50 60]*
           └── [10 11 12 13]*
    """
    tree, kv_pool, state_pool = make_tree(page_size=page_size, state_policy=policy)
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


def _pin_left_in_kv_lru(env: Env) -> None:
    """A broken ``pin_state``: the pin counted on the path, the node left in ``kv_lru``."""
    leaf = env.at(10, 11, 12)
    leaf.wait_pins += 1
    leaf.path_pins += 1


def _pin_lost_on_ancestor(env: Env) -> None:
    """A pin of C [6 7] (real API call) whose count was dropped on the tombstone above it."""
    env.tree.pin_state(env.at(*seq(1, 7)))
    env.tree.check_integrity()
    env.at(1, 2, 3, 4, 5).path_pins -= 1


def _double_free_kv(env: Env) -> None:
    """A free slot returned to the pool a second time."""
    free = env.kv_pool.free_slot_list()[0]
    env.kv_pool.free(torch.tensor([free]))


class Case(NamedTuple):
    """``corrupt(env)`` breaks one thing (it may return ``check_integrity`` kwargs); ``check``
    must be the one check that fires, with a message matching ``pattern`` (default: the
    check's own regex); ``page``: page size of the tree and its KV pool; ``policy``: its state
    eviction policy."""

    name: str
    corrupt: Callable[[Env], object]
    check: str
    pattern: str | None = None
    page: int = 1
    policy: str = "lru"


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


def _swap_heap_ends(env: Env) -> None:
    """A broken heap operation: the lowest entry and the last one trade places."""
    entries = env.tree.policy.tiers[0].entries
    assert entries[0][0] < entries[-1][0]
    entries[0], entries[-1] = entries[-1], entries[0]


def _stale_entry(env: Env) -> None:
    """A node re-added without its old entry dropped: the heap holds an entry it disowns."""
    leaf = _leaf(env)
    leaf.st_entry = list(leaf.st_entry)
