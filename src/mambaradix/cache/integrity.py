"""Full invariant check of a radix tree and its pools (design.md sec. 4.2). O(tree + pools):
for tests, property tests and an idle engine, never for hot paths."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mambaradix.cache.radix import RadixTree, TreeNode


class IntegrityError(AssertionError):
    """A broken invariant of the radix cache; the message names the node or slot."""


def _fail(msg: str) -> None:
    raise IntegrityError(msg)


def _check_nodes(tree: RadixTree) -> tuple[list[TreeNode], dict[str, int]]:
    """Structure, locks and per-node invariants; returns the non-root nodes and recomputed
    counters."""
    root = tree.root
    ps = tree.page_size
    pool_ps = getattr(tree.kv_pool, "page_size", 1)
    if root.parent is not None or root.key or root.depth != 0 or root.state_slot is not None:
        _fail(f"root must be the permanent empty prefix without state: {root!r}")
    if root.kv_lock != 1 or root.state_lock != 0:
        _fail(f"root must stay locked exactly once: {root!r}")
    if root.kv_link.nxt is not None or root.st_link.nxt is not None or root.st_entry is not None:
        _fail("root must not be in an LRU list or the state policy")
    nodes: list[TreeNode] = []
    seen = {id(root)}
    counts = dict(evictable_kv=0, protected_kv=0, evictable_state=0, protected_state=0)
    stack = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for ck, child in node.children.items():
            if id(child) in seen:
                _fail(f"node reachable twice (cycle or shared child): {child!r}")
            seen.add(id(child))
            if child.parent is not node:
                _fail(f"child's parent link is wrong: {child!r}")
            klen = len(child.key)
            if klen == 0 or klen % ps:
                _fail(f"edge length {klen} is not a positive multiple of page_size {ps}: {child!r}")
            if tree._child_key(child.key, 0) != ck:
                _fail(f"child stored under key {ck!r} but its edge starts differently: {child!r}")
            if child.kv.dim() != 1 or child.kv.numel() != klen or child.kv.dtype != torch.long:
                _fail(f"kv must be a 1-D long tensor of {klen} slots: {child!r}")
            if pool_ps > 1:
                pages = child.kv.view(-1, pool_ps)
                first = pages[:, :1]
                if bool((first % pool_ps != 0).any()) or not bool(
                    (pages == first + torch.arange(pool_ps)).all()
                ):
                    _fail(f"kv slots are not whole pages of {pool_ps}: {child!r}")
            if child.depth != node.depth + klen:
                _fail(f"depth {child.depth} != parent depth {node.depth} + {klen}: {child!r}")
            if child.kv_lock < 0 or child.state_lock < 0:
                _fail(f"negative lock count: {child!r}")
            if child.kv_lock < child.state_lock:
                _fail(f"kv_lock < state_lock: {child!r}")
            if child.state_lock and child.state_slot is None:
                _fail(f"state-locked node lost its state: {child!r}")
            if child.stored and child.state_slot is None:
                _fail(f"node marked stored without a state in RAM: {child!r}")
            if not child.children and child.state_slot is None and child.kv_lock == 0:
                _fail(f"tombstone leaf (unlocked leaf without a state): {child!r}")
            child_locks += child.kv_lock
            lock_key = "evictable_kv" if child.kv_lock == 0 else "protected_kv"
            counts[lock_key] += klen
            if child.state_slot is not None:
                key = "evictable_state" if child.state_lock == 0 else "protected_state"
                counts[key] += 1
            nodes.append(child)
            stack.append(child)
        if node is not root and child_locks > node.kv_lock:
            _fail(f"kv_lock {node.kv_lock} < sum of children's kv_lock {child_locks}: {node!r}")
    return nodes, counts


def _check_path_pins(nodes: list[TreeNode]) -> None:
    """``path_pins``: the wait_pins of the states at or below each node (``nodes`` in
    preorder, so reversed every child comes before its parent)."""
    below: dict[int, int] = {}
    for node in reversed(nodes):
        own = node.wait_pins if node.state_slot is not None else 0
        want = own + below.pop(id(node), 0)
        if node.path_pins != want:
            _fail(f"path_pins {node.path_pins} != the pins of the states on its path {want}: "
                  f"{node!r}")  # fmt: skip
        if node.parent.parent is not None:
            below[id(node.parent)] = below.get(id(node.parent), 0) + want


def _check_lists(tree: RadixTree, nodes: list[TreeNode], counts: dict[str, int]) -> None:
    ids = {id(n) for n in nodes}
    _check_path_pins(nodes)
    unlocked = [n for n in nodes if n.kv_lock == 0]
    order: dict[int, int] = {}
    for kv_list, pinned in ((tree.kv_lru, False), (tree.kv_pinned, True)):
        err = kv_list.check_links()
        if err:
            _fail("KV " + err)
        last_tick = None
        for i, link in enumerate(kv_list.iter_oldest_first(len(nodes) + 1)):
            node = link.owner
            if id(node) not in ids:
                _fail(f"KV-LRU holds a node that is not in the tree: {node!r}")
            if id(node) in order:
                _fail(f"KV-LRU holds a node twice: {node!r}")
            if node.kv_lock:
                _fail(f"KV-LRU holds a locked node: {node!r}")
            if link.home is not kv_list or bool(node.path_pins) != pinned:
                _fail(f"KV-LRU list does not match the node's path pins: {node!r}")
            if last_tick is not None and link.tick < last_tick:
                _fail(f"KV-LRU out of access order: tick {link.tick} after {last_tick} at {node!r}")
            last_tick = link.tick
            order[id(node)] = i
    listed = len(tree.kv_lru) + len(tree.kv_pinned)
    if len(order) != len(unlocked) or listed != len(unlocked):
        _fail(
            f"KV-LRU holds {len(order)} nodes (length {listed}), "
            f"expected every unlocked non-root node: {len(unlocked)}"
        )
    for node in unlocked:
        parent = node.parent
        if parent.parent is None or parent.kv_lock or parent.kv_link.home is not node.kv_link.home:
            continue
        if order[id(parent)] < order[id(node)]:
            _fail(f"unlocked parent older than its child in the KV-LRU: {parent!r}")
    err = tree.policy.check()
    if err:
        _fail(err)
    members = set()
    for node in tree.policy.members(len(nodes) + 1):
        if id(node) not in ids:
            _fail(f"state policy holds a node that is not in the tree: {node!r}")
        if id(node) in members:
            _fail(f"state policy holds a node twice: {node!r}")
        if node.state_slot is None or node.state_lock:
            _fail(f"state policy holds a node without an unlocked state: {node!r}")
        members.add(id(node))
    if len(members) != counts["evictable_state"] or len(tree.policy) != len(members):
        _fail(
            f"state policy holds {len(members)} nodes (length {len(tree.policy)}), expected "
            f"every node with an unlocked state: {counts['evictable_state']}"
        )
    actual = dict(
        evictable_kv=tree.evictable_kv(),
        protected_kv=tree.protected_kv(),
        evictable_state=tree.evictable_state(),
        protected_state=tree.protected_state(),
    )
    for name, value in counts.items():
        if actual[name] != value:
            _fail(f"counter {name} is {actual[name]}, recomputed {value}")
    if tree.num_nodes() != len(nodes):
        _fail(f"num_nodes() is {tree.num_nodes()}, the tree has {len(nodes)}")


def _check_slots(kind: str, size: int, sources: dict[str, list[int]]) -> None:
    """Every slot of a pool of ``size`` appears exactly once over ``sources``."""
    total = sum(len(v) for v in sources.values())
    per_source = {}
    for name, slots in sources.items():
        t = torch.tensor(slots, dtype=torch.long)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= size):
            _fail(f"{kind} slot out of range [0, {size}) in {name}")
        per_source[name] = torch.bincount(t, minlength=size)
    count = sum(per_source.values())
    bad = torch.nonzero(count != 1).flatten()
    if bad.numel() or total != size:
        slot = int(bad[0]) if bad.numel() else -1
        where = ", ".join(f"{name}: {int(c[slot])}" for name, c in per_source.items())
        problem = "leaked (in no place)" if slot >= 0 and int(count[slot]) == 0 else "duplicated"
        _fail(
            f"{kind} slot {slot} is {problem} ({where}); free + tree + held = {total}, "
            f"pool size {size}"
        )


def check_tree(
    tree: RadixTree, held_kv: Iterable[int] = (), held_state: Iterable[int] = ()
) -> None:
    nodes, counts = _check_nodes(tree)
    _check_lists(tree, nodes, counts)
    tree_kv = torch.cat([n.kv for n in nodes]).tolist() if nodes else []
    _check_slots(
        "KV",
        tree.kv_pool.size,
        dict(free=tree.kv_pool.free_slot_list(), tree=tree_kv, held=[int(s) for s in held_kv]),
    )
    tree_state = [n.state_slot for n in nodes if n.state_slot is not None]
    _check_slots(
        "state",
        tree.state_pool.size,
        dict(
            free=tree.state_pool.free_slot_list(),
            tree=tree_state,
            held=[int(s) for s in held_state],
        ),
    )
