"""Radix prefix tree over token ids holding attention KV for every cached token and recurrent
state snapshots at some node ends (design.md sec. 4).

A node's edge ``key`` is a run of tokens (whole pages when ``page_size`` > 1), ``kv`` their KV
slots, and ``state_slot`` the recurrent state after the node's last token (``None``: a
tombstone, whose KV is valid but where no request can resume). A request may resume only at the
end of a node with a state, so ``match`` returns the deepest such node within ``limit``::

    root ── [1 2 3]* ── [4 5] ──┬── [6 7]*        * = state snapshot at the node's end
                                └── [60 70]*      [4 5] is a tombstone (split point)

Locks: ``lock(node)`` adds one to ``kv_lock`` of the node and every ancestor (its KV path can't
be evicted); ``lock_state(node)`` protects only that node's state. Eviction touches only
unlocked entries and is O(1) per freed entry:

- the KV-LRU lists hold exactly the unlocked non-root nodes; locked nodes leave them and come
  back as newest when their last lock is released (a release is a use). Every touch walks from
  a node up to the root, so an unlocked parent is always newer than its children and the
  oldest entry is always a leaf. Two lists: nodes on the path of a pinned state
  (``path_pins`` > 0: a waiting request expects to resume there, ``pin_state``) sit in
  ``kv_pinned`` and go only when ``kv_lru`` is empty and the caller does not spare them, so
  KV pressure takes a waiting group's shared prefix last, as state pressure does; a parent's
  ``path_pins`` is at least its children's, so each list's oldest entry is a leaf;
- the state policy (``evict_policy``) holds exactly the nodes whose state is not state-locked.

A kv-locked node may transiently be a tombstone leaf (its state or its children were evicted
while a request held it); it is deleted when its last lock is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from mambaradix.cache.evict_policy import SPARE_NOTHING, SPARE_PINNED, make_state_policy
from mambaradix.cache.integrity import IntegrityError, check_tree
from mambaradix.cache.lru import LRULink, LRUList
from mambaradix.cache.tree_node import InsertResult, MatchResult, TreeNode, common_prefix_len

logger = logging.getLogger(__name__)

__all__ = ["InsertResult", "IntegrityError", "MatchResult", "RadixTree", "TreeNode"]


class RadixTree:
    """Prefix cache over a KV pool and a state pool. See the module docstring for the model.

    Contract with callers: slots handed to ``insert`` become the tree's (or are freed by it, see
    ``insert``); slots the tree holds are freed only by eviction or unlock cascades; nodes
    returned by ``match``/``insert`` stay valid only while the caller holds ``lock`` on them.
    """

    def __init__(
        self, kv_pool: object, state_pool: object, page_size: int = 1, state_policy: str = "lru"
    ) -> None:
        pool_page = getattr(kv_pool, "page_size", 1)
        if page_size < 1 or page_size % pool_page:
            raise ValueError(
                f"tree page_size {page_size} must be a positive multiple of the KV pool's "
                f"page_size {pool_page}"
            )
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.page_size = page_size
        self.policy = make_state_policy(state_policy, getattr(state_pool, "size", 0))
        self.kv_lru = LRUList()  # unlocked nodes on no pinned state's path
        self.kv_pinned = LRUList()  # unlocked nodes on a pinned state's path
        self.root = TreeNode(
            key=[], kv=torch.empty(0, dtype=torch.long), state_slot=None, parent=None, kv_lock=1
        )
        self._tick = 0
        self._num_nodes = 0
        self._evictable_kv = 0
        self._protected_kv = 0
        self._evictable_state = 0
        self._protected_state = 0
        # Called with a node whose state is about to be freed by eviction (or flush), while
        # its path is still in the pools: the storage tier demotes it there (write-back).
        self.on_evict: Callable[[TreeNode], None] | None = None

    # ------------------------------------------------------------------ lookups

    def _child_key(self, tokens: list[int], pos: int) -> object:
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos : pos + self.page_size])

    def match(self, tokens: list[int], limit: int | None = None) -> MatchResult:
        """Longest cached prefix of ``tokens``; never splits. Touches the KV-LRU along the path
        to the returned node and the state LRU of that node only."""
        if type(tokens) is not list:  # slices of tuples/arrays never equal list keys
            tokens = list(tokens)
        ps = self.page_size
        n = len(tokens)
        end = n - n % ps
        if limit is None or limit > n:
            limit = n
        node = self.root
        path: list[TreeNode] = []
        best = 0  # number of path nodes up to the best node
        pos = 0
        children = node.children
        while pos < end:
            child = children.get(tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            key = child.key
            klen = len(key)
            if pos + klen <= end and tokens[pos : pos + klen] == key:
                pos += klen
                path.append(child)
                if child.state_slot is not None and pos <= limit:
                    best = len(path)
                children = child.children
                continue
            m = min(common_prefix_len(key, tokens, pos), end - pos)
            pos += m - m % ps
            break
        if best == 0:
            return MatchResult(pos, 0, self.root, torch.empty(0, dtype=torch.long))
        used = path[:best]
        node = used[-1]
        self._tick += 1
        tick = self._tick
        for p in reversed(used):
            _touch(p.kv_link, tick)
        self.policy.touch(node, tick)
        kv = used[0].kv.clone() if best == 1 else torch.cat([p.kv for p in used])
        return MatchResult(pos, node.depth, node, kv)

    def path_kv(self, node: TreeNode) -> torch.Tensor:
        """KV slots of tokens [0, node.depth) (a fresh tensor)."""
        parts = []
        while node.parent is not None:
            parts.append(node.kv)
            node = node.parent
        if not parts:
            return torch.empty(0, dtype=torch.long)
        parts.reverse()
        return torch.cat(parts)

    def path_tokens(self, node: TreeNode) -> list[int]:
        """Tokens [0, node.depth)."""
        parts = []
        while node.parent is not None:
            parts.append(node.key)
            node = node.parent
        out: list[int] = []
        for key in reversed(parts):
            out.extend(key)
        return out

    def deepest_node(self, tokens: list[int], max_depth: int) -> TreeNode:
        """The deepest node (state or tombstone) whose whole edge path matches ``tokens`` and
        ends at or before ``max_depth``; never splits, touches nothing."""
        ps = self.page_size
        node, pos = self.root, 0
        while True:
            if pos >= len(tokens):
                return node
            child = node.children.get(tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps]))
            if child is None:
                return node
            klen = len(child.key)
            if pos + klen > max_depth or tokens[pos : pos + klen] != child.key:
                return node
            node, pos = child, pos + klen

    # ------------------------------------------------------------------ insert

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut ``child`` after ``m`` tokens; returns the new upper node (a tombstone)."""
        parent = child.parent
        upper = TreeNode(
            key=child.key[:m],
            kv=child.kv[:m],
            state_slot=None,
            parent=parent,
            kv_lock=child.kv_lock,
            depth=parent.depth + m,
        )
        ck = self._child_key(child.key, 0)
        child.key = child.key[m:]
        child.kv = child.kv[m:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[ck] = upper
        upper.path_pins = child.path_pins
        if child.kv_lock == 0:
            child.kv_link.home.insert_newer_than(child.kv_link, upper.kv_link)
        else:
            upper.kv_link.tick = child.kv_link.tick
        self._num_nodes += 1
        return upper

    def insert(
        self,
        tokens: list[int],
        kv_slots: torch.Tensor,
        state_slot: int | None = None,
        owned_from: int = 0,
    ) -> InsertResult:
        """Insert ``tokens`` with their KV slots and optionally the state after the last token.

        ``kv_slots[:owned_from]`` came from the tree (the caller's locked matched prefix) and are
        left alone; ``kv_slots[owned_from:existing_len]`` duplicate KV already in the tree and are
        freed here; ``kv_slots[existing_len:]`` become the tree's (see ``InsertResult`` for the
        stateless-tail case). Splits where needed. Touches the KV-LRU along the path and the
        state LRU only for an attached state.
        """
        if type(tokens) is not list:
            tokens = list(tokens)
        n = len(tokens)
        ps = self.page_size
        if n != kv_slots.numel() or n % ps:
            raise ValueError(
                f"insert needs len(tokens) == len(kv_slots) and a multiple of page_size {ps}; "
                f"got {n} tokens, {kv_slots.numel()} slots"
            )
        if n == 0:
            return InsertResult(0, self.root, False, 0)
        node = self.root
        pos = 0
        while pos < n:
            child = node.children.get(tokens[pos] if ps == 1 else tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            key = child.key
            klen = len(key)
            if pos + klen <= n and tokens[pos : pos + klen] == key:
                node = child
                pos += klen
                continue
            m = common_prefix_len(key, tokens, pos)
            m -= m % ps  # >= ps: the first page matched
            node = self._split(child, m)
            pos += m
            break
        existing_len = pos
        if owned_from > existing_len or owned_from < 0 or owned_from % ps:
            raise ValueError(
                f"owned_from {owned_from} must be a page-aligned prefix already in the tree "
                f"(existing_len {existing_len})"
            )
        if existing_len > owned_from:
            self.kv_pool.free(kv_slots[owned_from:existing_len])
        self._tick += 1
        tick = self._tick
        if pos < n and state_slot is not None:
            leaf = TreeNode(
                key=list(tokens[pos:]),
                kv=kv_slots[pos:].clone(),
                state_slot=None,
                parent=node,
                depth=n,
            )
            node.children[self._child_key(tokens, pos)] = leaf
            if len(node.children) == 2:
                self.mark_branch(node)
            elif node.state_slot is not None:  # its first child: a deeper state below it
                self.policy.refresh(node, tick)
            self.kv_lru.push_newest(leaf.kv_link, tick)
            self._evictable_kv += n - pos
            self._num_nodes += 1
            node = leaf
            pos = n
        p = node
        while p.parent is not None:
            _touch(p.kv_link, tick)
            p = p.parent
        attached = False
        if state_slot is not None and node.parent is not None and node.state_slot is None:
            node.state_slot = state_slot
            self.policy.add(node, tick)  # a tombstone is never state-locked
            self._evictable_state += 1
            attached = True
            if node.wait_pins:  # a tombstone some waiting request still pins
                self._pin_path(node, node.wait_pins)
        return InsertResult(existing_len, node, attached, pos)

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        """Protect the KV of ``node`` and all its ancestors (one count per call)."""
        while node.parent is not None:
            if node.kv_lock == 0:
                node.kv_link.home.remove(node.kv_link)
                klen = len(node.key)
                self._evictable_kv -= klen
                self._protected_kv += klen
            node.kv_lock += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Release one ``lock``. Entries reaching zero locks count as just used; a tombstone leaf
        left unlocked is deleted (cascading), freeing its KV."""
        if node.parent is None:
            return
        if node.kv_lock <= 0:
            raise ValueError(f"unlock of a node that is not locked: {node!r}")
        self._tick += 1
        tick = self._tick
        start = node
        while node.parent is not None:
            node.kv_lock -= 1
            if node.kv_lock == 0:
                self._kv_list(node).push_newest(node.kv_link, tick)
                klen = len(node.key)
                self._evictable_kv += klen
                self._protected_kv -= klen
            node = node.parent
        if start.kv_lock == 0 and start.state_slot is None and not start.children:
            self._delete_cascade(start)

    def lock_state(self, node: TreeNode) -> None:
        """Protect ``node``'s state (the node must hold a state and be kv-locked)."""
        if node.parent is None:
            return
        if node.state_slot is None or node.kv_lock <= node.state_lock:
            raise ValueError(f"lock_state needs a kv-locked node with a state: {node!r}")
        if node.state_lock == 0:
            self.policy.remove(node)
            self._evictable_state -= 1
            self._protected_state += 1
        node.state_lock += 1

    def unlock_state(self, node: TreeNode) -> None:
        if node.parent is None:
            return
        if node.state_lock <= 0:
            raise ValueError(f"unlock_state of a node whose state is not locked: {node!r}")
        node.state_lock -= 1
        if node.state_lock == 0:
            self._tick += 1
            self.policy.add(node, self._tick)
            self._evictable_state += 1
            self._protected_state -= 1

    def pin_state(self, node: TreeNode) -> None:
        """A waiting request expects to resume from ``node``'s state (one count per call): the
        policy frees it only after every unpinned state, and never for an optional slot (a
        snapshot's, a verify step's: ``evict_state``'s ``spare``). A soft pin: admission
        still evicts it when nothing else is left (the request then recomputes), so pins can
        never keep requests waiting."""
        self._repin(node, +1)

    def unpin_state(self, node: TreeNode) -> None:
        """Release one ``pin_state``; the node may have been evicted (even deleted) since."""
        if node.wait_pins <= 0:
            raise ValueError(f"unpin_state of a node that is not pinned: {node!r}")
        self._repin(node, -1)

    def mark_branch(self, node: TreeNode) -> None:
        """Requests went on from ``node`` in different ways (the planner's branch point): its
        state moves to the policy's branch tier for good. A node becomes one by itself when it
        gets a second child."""
        if node is self.root or node.branched:
            return
        node.branched = True
        self._tick += 1
        self.policy.refresh(node, self._tick)

    def _repin(self, node: TreeNode, delta: int) -> None:
        if node is self.root:
            return
        node.wait_pins += delta
        self._tick += 1
        self.policy.refresh(node, self._tick)
        if node.state_slot is not None:  # (a freed or deleted state's pins protect no KV)
            self._pin_path(node, delta)

    def _kv_list(self, node: TreeNode) -> LRUList:
        return self.kv_pinned if node.path_pins else self.kv_lru

    def _pin_path(self, node: TreeNode, delta: int) -> None:
        """Add ``delta`` to ``path_pins`` from ``node`` up to the root, moving each unlocked
        node to the KV list it now belongs in, as newest (each after its child: parents stay
        newer). Pins change once per waiting request, not per step."""
        self._tick += 1
        tick = self._tick
        while node.parent is not None:
            node.path_pins += delta
            link = node.kv_link
            if link.home is not None:
                link.home.remove(link)
                self._kv_list(node).push_newest(link, tick)
            node = node.parent

    # ------------------------------------------------------------------ eviction

    def _delete_cascade(self, node: TreeNode) -> int:
        """Delete an unlocked leaf, then its ancestors that become unlocked tombstone leaves.
        Returns the KV slots freed."""
        freed = 0
        while True:
            parent = node.parent
            node.kv_link.home.remove(node.kv_link)
            klen = len(node.key)
            self.kv_pool.free(node.kv)
            freed += klen
            self._evictable_kv -= klen
            if node.state_slot is not None:
                if self.on_evict is not None:
                    self.on_evict(node)
                self.policy.remove(node)
                self.state_pool.free([node.state_slot])
                self._evictable_state -= 1
                if node.wait_pins:
                    self._pin_path(node, -node.wait_pins)
                node.state_slot = None
            del parent.children[self._child_key(node.key, 0)]
            node.parent = None
            self._num_nodes -= 1
            if not parent.children and parent.state_slot is not None:
                self.policy.refresh(parent, self._tick)  # the deepest state of its path again
            if (
                parent.parent is None
                or parent.children
                or parent.state_slot is not None
                or parent.kv_lock
            ):
                return freed
            node = parent

    def evict_kv(self, num_tokens: int, spare: int = SPARE_NOTHING) -> int:
        """Delete least recently used unlocked leaves (KV and state), cascading through childless
        unlocked tombstones, until ``num_tokens`` KV slots are freed or nothing is evictable.
        Leaves on a pinned state's path go after all others, and not at all when ``spare`` is
        ``SPARE_PINNED`` or more (an admission while requests run that free KV by finishing)."""
        freed = 0
        while freed < num_tokens:
            link = self.kv_lru.oldest()
            if link is None and spare < SPARE_PINNED:
                link = self.kv_pinned.oldest()
            if link is None:
                break
            node = link.owner
            if node.children:  # impossible while parents stay newer than children
                raise IntegrityError(f"oldest KV-LRU entry is not a leaf: {node!r}")
            freed += self._delete_cascade(node)
        return freed

    def evict_state(self, num_slots: int, spare: int = SPARE_NOTHING) -> int:
        """Free the least valuable unlocked states (per policy): an internal or kv-locked node
        becomes a tombstone, an unlocked leaf is deleted (cascading, freeing its KV too).
        ``spare``: the tiers left alone (``evict_policy``: pinned states, branch points)."""
        freed = 0
        policy = self.policy
        while freed < num_slots:
            node = policy.victim(spare)
            if node is None:
                break
            if node.children or node.kv_lock:
                if self.on_evict is not None:
                    self.on_evict(node)
                policy.remove(node)
                self.state_pool.free([node.state_slot])
                if node.wait_pins:
                    self._pin_path(node, -node.wait_pins)
                node.state_slot = None
                node.stored = False  # describes the state it held
                self._evictable_state -= 1
            else:
                self._delete_cascade(node)
            freed += 1
        return freed

    def flush(self) -> int | None:
        """Empty the tree: free every cached KV slot and state slot, leaving only the root.

        Refused (returns None, nothing freed) while any lock is held, i.e. while a request
        uses a cached prefix; otherwise returns the number of KV slots freed."""
        if self._protected_kv or self._protected_state:
            return None
        freed = self.evict_kv(self._evictable_kv + 1)
        if self._num_nodes:  # every unlocked node is in the KV-LRU, so nothing can remain
            raise IntegrityError(f"flush left {self._num_nodes} nodes in the tree")
        return freed

    # ------------------------------------------------------------------ accounting

    def evictable_kv(self) -> int:
        return self._evictable_kv

    def protected_kv(self) -> int:
        return self._protected_kv

    def evictable_state(self) -> int:
        return self._evictable_state

    def protected_state(self) -> int:
        return self._protected_state

    def total_kv(self) -> int:
        return self._evictable_kv + self._protected_kv

    def total_state(self) -> int:
        return self._evictable_state + self._protected_state

    def num_nodes(self) -> int:
        """Nodes in the tree, not counting the root."""
        return self._num_nodes

    def check_integrity(self, held_kv: Iterable[int] = (), held_state: Iterable[int] = ()) -> None:
        """Raise ``IntegrityError`` naming the first broken invariant (design.md sec. 4.2).
        ``held_kv`` / ``held_state``: slots that live requests hold outside the tree."""
        check_tree(self, held_kv, held_state)


def _touch(link: LRULink, tick: int) -> None:
    """A use of a node's KV: newest in the list it is in, or only the tick if in none."""
    if link.home is None:
        link.tick = tick
    else:
        link.home.touch(link, tick)
