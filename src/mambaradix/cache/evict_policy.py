"""State eviction policies: which unlocked state snapshot the tree frees first.

The radix tree tells the policy when a node's state becomes evictable (``add``), stops being
evictable (``remove``: freed, or state-locked by a request), or is used (``touch``: a request
resumes from it). ``victim`` names the next state to free without removing it. Every operation
must be O(1) amortized; the tree never scans all states.

A state some waiting request expects to resume from (``node.wait_pins`` > 0, set by the tree's
``pin_state``) goes only after every state without: a soft pin. The tree changes ``wait_pins``
only while the node is out of the policy (``remove``, then ``add`` again), so a policy reads it
in ``add`` and may trust it until ``remove``.

``lru`` (the default) frees the least recently used state. A value-aware policy (compute saved
per byte combined with recency, as in the Marconi paper) plugs in by subclassing
``StatePolicy`` and registering a name in ``STATE_POLICIES``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from mambaradix.cache.lru import LRUList

if TYPE_CHECKING:
    from mambaradix.cache.radix import TreeNode


class StatePolicy:
    """Interface of a state eviction policy over tree nodes that hold an unlocked state."""

    name = "abstract"

    def add(self, node: TreeNode, tick: int) -> None:
        raise NotImplementedError

    def remove(self, node: TreeNode) -> None:
        raise NotImplementedError

    def touch(self, node: TreeNode, tick: int) -> None:
        """Record a use of ``node``'s state; also called for nodes not held (locked ones)."""
        raise NotImplementedError

    def victim(self, pinned: bool = True) -> TreeNode | None:
        """The next state to free; ``pinned`` False: never a pinned one."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def members(self, limit: int) -> Iterator[TreeNode]:
        """Every held node, in eviction order (for integrity checks)."""
        raise NotImplementedError

    def check(self) -> str | None:
        """Describe a broken internal invariant, or None."""
        raise NotImplementedError


class LRUStatePolicy(StatePolicy):
    """Least recently used state first, the pinned ones after all others (each tier in LRU
    order); uses each node's ``st_link``."""

    name = "lru"

    def __init__(self) -> None:
        self.lru = LRUList()
        self.pinned = LRUList()

    def _list(self, node: TreeNode) -> LRUList:
        return self.pinned if node.wait_pins else self.lru

    def add(self, node: TreeNode, tick: int) -> None:
        self._list(node).push_newest(node.st_link, tick)

    def remove(self, node: TreeNode) -> None:
        self._list(node).remove(node.st_link)

    def touch(self, node: TreeNode, tick: int) -> None:
        self._list(node).touch(node.st_link, tick)

    def victim(self, pinned: bool = True) -> TreeNode | None:
        link = self.lru.oldest() or (self.pinned.oldest() if pinned else None)
        return None if link is None else link.owner

    def __len__(self) -> int:
        return len(self.lru) + len(self.pinned)

    def members(self, limit: int) -> Iterator[TreeNode]:
        for tier in (self.lru, self.pinned):
            for link in tier.iter_oldest_first(limit):
                yield link.owner

    def check(self) -> str | None:
        for tier, pinned in ((self.lru, False), (self.pinned, True)):
            err = tier.check_links()
            if err:
                return "state " + err
            last = None
            for link in tier.iter_oldest_first(len(tier) + 1):
                if last is not None and link.tick < last:
                    return f"state LRU out of access order (tick {link.tick} after {last})"
                if (link.owner.wait_pins > 0) != pinned:
                    return f"state LRU tier does not match the pins: {link.owner!r}"
                last = link.tick
        return None


STATE_POLICIES: dict[str, type[StatePolicy]] = {"lru": LRUStatePolicy}


def make_state_policy(name: str) -> StatePolicy:
    try:
        return STATE_POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown state eviction policy {name!r}; choose one of {sorted(STATE_POLICIES)}"
        ) from None
