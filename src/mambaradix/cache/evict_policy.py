"""State eviction policies: which unlocked state snapshot the tree frees first.

The radix tree tells the policy when a node's state becomes evictable (``add``), stops being
evictable (``remove``: freed, or state-locked by a request), is used (``touch``: a request
resumes from it), or may belong in another tier or be worth something else (``refresh``: a
waiting request pinned or released it, it became a branch point, it gained its first child or
lost its last). ``victim`` names the next state to free
without removing it. Every operation must be O(1) amortized; the tree never scans all states.

``lru`` keeps three tiers, each in least-recently-used order, and frees from the
first that has a state:

1. states at other nodes: a finish, an exact-repeat point, a chat turn's end, a decode
   interval, which one continuation at most has reused;
2. **branch points** (``node.branched``: a node that has had two children, or where the planner
   saw requests branch or share; kept when the children are evicted): prefixes that different
   requests went on from (a system prompt, a few-shot header), the states most likely to be
   used again.
   While this tier holds more than half the pool, its oldest goes first, so old branch points
   cannot crowd the states of running conversations out;
3. states some waiting request expects to resume from (``node.wait_pins`` > 0, the tree's
   ``pin_state``): only when nothing else is left (a soft pin).

A caller may ask to spare the later tiers (``victim``'s ``spare``): an optional slot (a
snapshot's, a verify step's) is not worth a branch point or a pinned state, and is skipped
instead; a branch point's own snapshot spares the pinned states only.

Without the second tier a small pool lost every shared prompt when requests of several groups
arrived one after another: each request's own snapshots (repeat point, finish) were newer than
its group's branch point, so LRU freed the branch point before the group's next request came.
``value`` (the engine's default) keeps the same tiers and the same spares, and orders each tier by
what a state is worth instead of by its last use alone: GreedyDual (Young; Cao and Irani's
GreedyDual-Size), the recency-and-cost rule the Marconi paper's eviction also weighs. A state's
priority is ``clock + value``, its value the tokens a request resuming there does not compute: its
depth (a prefill's cost grows with the tokens; attention's quadratic share stays under a tenth below
8k tokens for the published hybrids, whose few attention layers are a small part of a token's
FLOPs). Every slot is the same size, so the tokens are the compute saved per byte. A state with a
child (not a branch point, not pinned) is worth 0 while the child is there: a request going on along
that path resumes from the deeper state (a chat's earlier turn, once the next turn's state is in;
LRU frees those first only because they are older).

An add or a use sets the priority from the current clock; the victim is the lowest priority,
and evicting it advances the clock to that priority. An add also advances the clock by its
depth over the pool's slots (its share of a turnover: the rate evictions set once the pool is
full), so states added while the pool fills, before any eviction moved the clock, are not
ordered by depth alone: between states of nearly one depth the older goes first, as under LRU.
A state then ages as others come and go, slower the deeper it is: one of 8,192 tokens unused
outlives many turnovers of 128-token states, which LRU frees first whenever it is the oldest,
and LRU's cyclic worst case (sessions coming back in turn, one more than fit) keeps the deepest
sessions instead of losing every one. Each tier is a binary heap with lazy deletion: O(log n)
per operation.

Another policy plugs in by subclassing ``StatePolicy`` and registering a name in
``STATE_POLICIES``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING

from mambaradix.cache.lru import LRUList

if TYPE_CHECKING:
    from mambaradix.cache.radix import TreeNode

# what an eviction may not take (``victim``'s ``spare``), from least to most
SPARE_NOTHING = 0  # admission with nothing running: pins must never keep requests waiting
SPARE_PINNED = 1  # admission while requests run, a storage load, a branch point's snapshot
SPARE_SHARED = 2  # other optional slots: branch points (within their tier's cap) and pins too


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

    def refresh(self, node: TreeNode, tick: int) -> None:
        """``node``'s pins or children changed: move it to the tier it now belongs in, if it
        is held; also called for nodes not held."""
        raise NotImplementedError

    def victim(self, spare: int = SPARE_NOTHING) -> TreeNode | None:
        """The next state to free, none of those ``spare`` protects (None: nothing left)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def members(self, limit: int) -> Iterator[TreeNode]:
        """Every held node, in eviction order (for integrity checks)."""
        raise NotImplementedError

    def check(self) -> str | None:
        """Describe a broken internal invariant, or None."""
        raise NotImplementedError


class _TieredPolicy(StatePolicy):
    """The three tiers both policies share (the module docstring): ``tiers`` = (others, branch
    points, pinned), each a container with ``len``; a subclass orders within a tier
    (``_first``)."""

    def __init__(self, tiers: tuple, capacity: int) -> None:
        self.tiers = tiers
        self.branch_cap = capacity // 2  # beyond it the branch tier's first goes first

    def _tier(self, node: TreeNode):
        others, branch, pinned = self.tiers
        if node.wait_pins:
            return pinned
        return branch if node.branched else others

    def _first(self, tier) -> TreeNode | None:
        """The node ``tier`` frees first (None: it is empty)."""
        raise NotImplementedError

    def victim(self, spare: int = SPARE_NOTHING) -> TreeNode | None:
        others, branch, pinned = self.tiers
        if len(branch) > self.branch_cap:
            node = self._first(branch)
        else:
            node = self._first(others)
            if node is None and spare < SPARE_SHARED:
                node = self._first(branch)
        if node is None and spare < SPARE_PINNED:
            node = self._first(pinned)
        return node

    def __len__(self) -> int:
        return sum(len(tier) for tier in self.tiers)


class LRUStatePolicy(_TieredPolicy):
    """Least recently used state first within each tier; uses each node's ``st_link``."""

    name = "lru"

    def __init__(self, capacity: int = 0) -> None:
        self.lru = LRUList()  # fewer than two children
        self.branch = LRUList()  # two or more children
        self.pinned = LRUList()
        super().__init__((self.lru, self.branch, self.pinned), capacity)

    def _first(self, tier: LRUList) -> TreeNode | None:
        link = tier.oldest()
        return None if link is None else link.owner

    def add(self, node: TreeNode, tick: int) -> None:
        self._tier(node).push_newest(node.st_link, tick)

    def remove(self, node: TreeNode) -> None:
        node.st_link.home.remove(node.st_link)

    def touch(self, node: TreeNode, tick: int) -> None:
        link = node.st_link
        if link.home is None:
            link.tick = tick
        else:
            link.home.touch(link, tick)

    def refresh(self, node: TreeNode, tick: int) -> None:
        link = node.st_link
        tier = self._tier(node)
        if link.home is not None and link.home is not tier:
            link.home.remove(link)
            tier.push_newest(link, tick)

    def members(self, limit: int) -> Iterator[TreeNode]:
        for tier in self.tiers:
            for link in tier.iter_oldest_first(limit):
                yield link.owner

    def check(self) -> str | None:
        for tier in self.tiers:
            err = tier.check_links()
            if err:
                return "state " + err
            last = None
            for link in tier.iter_oldest_first(len(tier) + 1):
                if last is not None and link.tick < last:
                    return f"state LRU out of access order (tick {link.tick} after {last})"
                if link.home is not tier or self._tier(link.owner) is not tier:
                    return (
                        f"state LRU tier does not match the node's pins or children: {link.owner!r}"
                    )
                last = link.tick
        return None


class _ValueHeap:
    """One tier of ``ValueStatePolicy``: entries ``[priority, seq, node, heap]``, lowest
    first; a removed entry stays in the list with ``node`` None until it reaches the top or
    the list is rebuilt (``node.st_entry`` names the live entry)."""

    __slots__ = ("entries", "live")

    def __init__(self) -> None:
        self.entries: list[list] = []
        self.live = 0

    def __len__(self) -> int:
        return self.live

    def push(self, entry: list) -> None:
        heapq.heappush(self.entries, entry)
        self.live += 1

    def drop(self, entry: list) -> None:
        entry[2] = None
        self.live -= 1
        if len(self.entries) > 2 * self.live + 64:  # bound the dead entries
            self.entries = [e for e in self.entries if e[2] is not None]
            heapq.heapify(self.entries)

    def top(self) -> list | None:
        entries = self.entries
        while entries and entries[0][2] is None:
            heapq.heappop(entries)
        return entries[0] if entries else None


class ValueStatePolicy(_TieredPolicy):
    """GreedyDual by the tokens a state saves, within the LRU policy's three tiers (the module
    docstring); uses each node's ``st_entry``: ``[priority, seq, node, heap, base]``, where
    ``base`` is the clock at the node's last add or use and priority = base + value."""

    name = "value"

    def __init__(self, capacity: int = 0) -> None:
        super().__init__((_ValueHeap(), _ValueHeap(), _ValueHeap()), capacity)
        self.clock = 0
        self._seq = 0  # ties go to the older entry
        self.capacity = max(1, capacity)

    def _first(self, tier: _ValueHeap) -> TreeNode | None:
        entry = tier.top()
        return None if entry is None else entry[2]

    @staticmethod
    def value(node: TreeNode) -> int:
        """The tokens a resume from ``node`` saves that no deeper state saves as well: its
        depth, or 0 while it has a child and is neither a branch point nor pinned (a request
        going on along the child resumes from the state below, and one diverging exactly here
        would make it a branch point)."""
        if node.children and not node.branched and not node.wait_pins:
            return 0
        return node.depth

    def _push(self, node: TreeNode, base: int) -> None:
        self._seq += 1
        entry = [base + self.value(node), self._seq, node, self._tier(node), base]
        node.st_entry = entry
        entry[3].push(entry)

    def add(self, node: TreeNode, tick: int) -> None:
        self._push(node, self.clock)
        self.clock += node.depth // self.capacity  # its share of a turnover: the others age

    def remove(self, node: TreeNode) -> None:
        entry = node.st_entry
        node.st_entry = None
        entry[3].drop(entry)

    def touch(self, node: TreeNode, tick: int) -> None:
        if node.st_entry is not None:  # a locked state is re-added at the clock of its unlock
            self.remove(node)
            self._push(node, self.clock)

    def refresh(self, node: TreeNode, tick: int) -> None:
        entry = node.st_entry
        if entry is None:
            return
        if entry[3] is not self._tier(node):  # pinned, released or branched: as if used
            self.remove(node)
            self._push(node, self.clock)
        elif entry[0] != entry[4] + self.value(node):  # gained or lost its only child
            self.remove(node)
            self._push(node, entry[4])

    def victim(self, spare: int = SPARE_NOTHING) -> TreeNode | None:
        node = super().victim(spare)
        if node is not None:  # the tree frees the victim it is given
            self.clock = max(self.clock, node.st_entry[0])
        return node

    def members(self, limit: int) -> Iterator[TreeNode]:
        for tier in self.tiers:
            live = sorted((e for e in tier.entries if e[2] is not None), key=lambda e: e[:2])
            for entry in live[:limit]:
                yield entry[2]

    def check(self) -> str | None:
        for tier in self.tiers:
            entries, live = tier.entries, 0
            for i, entry in enumerate(entries):
                if i and entries[(i - 1) // 2][:2] > entry[:2]:
                    return f"state value heap out of order at entry {i}"
                node = entry[2]
                if node is None:
                    continue
                live += 1
                if node.st_entry is not entry or entry[3] is not tier:
                    return f"state value heap entry is not the node's own: {node!r}"
                if self._tier(node) is not tier:
                    return f"state value tier does not match the node's pins or children: {node!r}"
                if entry[4] > self.clock:
                    return f"state priority based on a clock ahead of the policy's: {node!r}"
                if entry[0] != entry[4] + self.value(node):
                    return f"state priority out of step with the node's children: {node!r}"
            if live != tier.live:
                return f"state value heap holds {live} live entries, its count says {tier.live}"
        return None


STATE_POLICIES: dict[str, type[StatePolicy]] = {"lru": LRUStatePolicy, "value": ValueStatePolicy}


def make_state_policy(name: str, capacity: int = 0) -> StatePolicy:
    """The policy ``name`` over a state pool of ``capacity`` slots."""
    try:
        return STATE_POLICIES[name](capacity)
    except KeyError:
        raise ValueError(
            f"unknown state eviction policy {name!r}; choose one of {sorted(STATE_POLICIES)}"
        ) from None
