"""Intrusive doubly linked LRU list with O(1) push, remove, touch and oldest.

Each tree node owns one ``LRULink`` per list it can be in. The list is circular around a
sentinel: following ``nxt`` from the sentinel walks from the newest entry to the oldest, and
following ``prv`` walks from the oldest to the newest. A link is in a list iff ``nxt`` is set.
Every link carries the tick of its last access; ticks never decrease from oldest to newest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class LRULink:
    owner: object
    tick: int = 0
    prv: LRULink | None = None  # toward the newer end
    nxt: LRULink | None = None  # toward the older end
    home: LRUList | None = None  # the list it is in (None: in none)


class LRUList:
    """Access-ordered list of links; the caller supplies monotonically increasing ticks."""

    __slots__ = ("_s", "_len")

    def __init__(self) -> None:
        s = LRULink(None)
        s.prv = s
        s.nxt = s
        self._s = s
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push_newest(self, link: LRULink, tick: int) -> None:
        s = self._s
        first = s.nxt
        link.tick = tick
        link.prv = s
        link.nxt = first
        first.prv = link
        s.nxt = link
        link.home = self
        self._len += 1

    def remove(self, link: LRULink) -> None:
        p, n = link.prv, link.nxt
        p.nxt = n
        n.prv = p
        link.prv = None
        link.nxt = None
        link.home = None
        self._len -= 1

    def touch(self, link: LRULink, tick: int) -> None:
        """Record an access: move to the newest end if listed, else only stamp the tick."""
        link.tick = tick
        if link.nxt is None:
            return
        s = self._s
        if s.nxt is link:
            return
        p, n = link.prv, link.nxt
        p.nxt = n
        n.prv = p
        first = s.nxt
        link.prv = s
        link.nxt = first
        first.prv = link
        s.nxt = link

    def insert_newer_than(self, anchor: LRULink, link: LRULink) -> None:
        """Place ``link`` right on the newer side of ``anchor`` with the anchor's tick."""
        link.tick = anchor.tick
        p = anchor.prv
        link.prv = p
        link.nxt = anchor
        p.nxt = link
        anchor.prv = link
        link.home = self
        self._len += 1

    def oldest(self) -> LRULink | None:
        link = self._s.prv
        return None if link is self._s else link

    def newer(self, link: LRULink) -> LRULink | None:
        """The next entry toward the newer end, or None at the newest."""
        p = link.prv
        return None if p is self._s else p

    def iter_oldest_first(self, limit: int) -> Iterator[LRULink]:
        """Walk at most ``limit`` links from the oldest (bounded so a corrupted cycle ends)."""
        s = self._s
        link = s.prv
        steps = 0
        while link is not s and link is not None and steps < limit:
            yield link
            link = link.prv
            steps += 1

    def check_links(self) -> str | None:
        """Return a description of the first broken back-link, or None (integrity checks)."""
        s = self._s
        link = s
        for _ in range(self._len + 1):
            n = link.nxt
            if n is None or n.prv is not link:
                return "LRU list has a broken link"
            link = n
        if link is not s:
            return f"LRU list holds more entries than its length {self._len}"
        return None
