"""State eviction policies: which unlocked state snapshot the tree frees first.

The radix tree tells the policy when a node's state becomes evictable (``add``), stops being
evictable (``remove``: freed, or state-locked by a request), or is used (``touch``: a request
resumes from it). ``victim`` names the next state to free without removing it. Every operation
must be O(1) amortized; the tree never scans all states.

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

    def victim(self) -> TreeNode | None:
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
    """Least recently used state first; uses each node's ``st_link``."""

    name = "lru"

    def __init__(self) -> None:
        self.lru = LRUList()

    def add(self, node: TreeNode, tick: int) -> None:
        self.lru.push_newest(node.st_link, tick)

    def remove(self, node: TreeNode) -> None:
        self.lru.remove(node.st_link)

    def touch(self, node: TreeNode, tick: int) -> None:
        self.lru.touch(node.st_link, tick)

    def victim(self) -> TreeNode | None:
        link = self.lru.oldest()
        return None if link is None else link.owner

    def __len__(self) -> int:
        return len(self.lru)

    def members(self, limit: int) -> Iterator[TreeNode]:
        for link in self.lru.iter_oldest_first(limit):
            yield link.owner

    def check(self) -> str | None:
        err = self.lru.check_links()
        if err:
            return "state " + err
        last = None
        for link in self.lru.iter_oldest_first(len(self.lru) + 1):
            if last is not None and link.tick < last:
                return f"state LRU out of access order (tick {link.tick} after {last})"
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
