"""Hypothesis stateful test: random inserts, lookups, requests (match, lock, allocate own KV and
state, finish by inserting, or abort), waiting requests' soft pins, branch points, evictions
sparing either, checked against a brute-force reference.

The reference is the set of cached prefixes (one tuple per page boundary) and the subset where a
state exists. Insert and lookup results are predicted from it exactly; evictions and unlocks may
remove any unlocked entries, so after them the test checks what was removed (a subset, never a
locked entry, the freed counts add up) and then adopts the tree's content.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_radix_helpers import make_tree

from mambaradix.cache.evict_policy import SPARE_NOTHING, SPARE_PINNED, SPARE_SHARED

MAX_LIVE = 4


@dataclass(eq=False)
class Req:
    tokens: list[int]
    node: object
    prefix_len: int
    prefix_kv: torch.Tensor
    state_locked: bool
    own_kv: torch.Tensor | None = None
    state: int | None = None


def tokens_for(page: int) -> st.SearchStrategy[list[int]]:
    """Small alphabets so prefixes collide; with pages, pages differ only near their end so
    sequences diverge mid-page too."""
    if page == 1:
        return st.lists(st.integers(0, 3), min_size=1, max_size=10)
    page_st = st.one_of(
        st.tuples(st.integers(0, 1), st.integers(0, 1)).map(lambda xy: [0] * (page - 2) + list(xy)),
        st.integers(1, 3).map(lambda c: [c] * page),
    )
    return st.lists(page_st, min_size=1, max_size=4).map(lambda ps: [t for p in ps for t in p])


def content(tree) -> tuple[set, set]:
    """Every cached prefix (at page boundaries) and those with a state; touches nothing."""
    ps = tree.page_size
    kv, states = set(), set()
    stack = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for i in range(0, len(child.key), ps):
                p = p + tuple(child.key[i : i + ps])
                kv.add(p)
            if child.state_slot is not None:
                states.add(p)
            stack.append((child, p))
    return kv, states


class RadixMachine(RuleBasedStateMachine):
    PAGE = 1
    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        ps = self.PAGE
        self.tree, self.kv_pool, self.state_pool = make_tree(
            kv_size=40 * ps if ps == 1 else 12 * ps,
            state_size=6,
            page_size=ps,
            state_policy=self.POLICY,
        )
        self.kv_ref: set = set()
        self.st_ref: set = set()
        self.reqs: list[Req] = []
        self.pins: list = []  # nodes pinned (one entry per pin_state), maybe evicted since
        self.history: list[list[int]] = []  # recently inserted sequences, to draw near them

    def draw_tokens(self, data) -> list[int]:
        """A fresh sequence, or a page-aligned prefix of a recent one, optionally diverging
        inside the next page, followed by fresh pages (bounded length)."""
        ps = self.PAGE
        fresh = data.draw(tokens_for(ps))
        if not self.history or data.draw(st.booleans()):
            return fresh
        base = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(base) // ps)) * ps
        out = base[:cut]
        if cut < len(base) and data.draw(st.booleans()):
            page = base[cut : cut + ps]
            j = data.draw(st.integers(0, ps - 1))
            out = out + page[:j] + [(page[j] + 1) % 4] + page[j + 1 :]
        return (out + fresh)[: 10 * ps if ps == 1 else 4 * ps]

    def remember(self, tokens: list[int]) -> None:
        self.history = [*self.history[-7:], tokens]

    # ---------------------------------------------------------------- reference helpers

    def ref_kv_len(self, tokens: list[int]) -> int:
        ps, n = self.PAGE, 0
        while n + ps <= len(tokens) and tuple(tokens[: n + ps]) in self.kv_ref:
            n += ps
        return n

    def ref_prefix_len(self, tokens: list[int], limit: int) -> int:
        best = 0
        for n in range(self.PAGE, min(limit, len(tokens)) + 1, self.PAGE):
            if tuple(tokens[:n]) in self.st_ref:
                best = n
        return best

    def add_ref(self, tokens: list[int], length: int, state: bool) -> None:
        for n in range(self.PAGE, length + 1, self.PAGE):
            self.kv_ref.add(tuple(tokens[:n]))
        if state:
            self.st_ref.add(tuple(tokens[:length]))

    def protected(self) -> tuple[set, set]:
        kv, states = set(), set()
        for r in self.reqs:
            for n in range(self.PAGE, r.prefix_len + 1, self.PAGE):
                kv.add(tuple(r.tokens[:n]))
            if r.state_locked:
                states.add(tuple(r.tokens[: r.prefix_len]))
        return kv, states

    def adopt_after_removal(self) -> tuple[int, int]:
        """Check the tree only lost unlocked entries; adopt its content. Returns (KV tokens,
        states) removed."""
        kv, states = content(self.tree)
        assert kv <= self.kv_ref and states <= self.st_ref, "eviction added entries"
        locked_kv, locked_states = self.protected()
        assert locked_kv <= kv, "a kv-locked prefix was evicted"
        assert locked_states <= states, "a state-locked state was evicted"
        removed = ((len(self.kv_ref) - len(kv)) * self.PAGE, len(self.st_ref) - len(states))
        self.kv_ref, self.st_ref = kv, states
        return removed

    def alloc_kv(self, n: int) -> torch.Tensor | None:
        short = n - self.kv_pool.available()
        if short > 0:
            self.do_evict_kv(short)
        return self.kv_pool.alloc(n)

    def alloc_state(self) -> int | None:
        if self.state_pool.available() == 0:
            self.do_evict_state(1)
        got = self.state_pool.alloc(1)
        return None if got is None else got[0]

    def pinned_kv(self) -> set:
        """The KV prefixes on the paths of pinned states (the KV-LRU's second list)."""
        out = set()
        for p in self.pins:
            if p.state_slot is not None and p.parent is not None:
                path = self.tree.path_tokens(p)
                out.update(tuple(path[:n]) for n in range(self.PAGE, len(path) + 1, self.PAGE))
        return out

    def do_evict_kv(self, n: int, spare: int = SPARE_NOTHING) -> None:
        pinned = self.pinned_kv()
        in_pinned = sum(len(link.owner.key) for link in self.tree.kv_pinned.iter_oldest_first(999))
        unpinned = self.tree.evictable_kv() - in_pinned
        freed = self.tree.evict_kv(n, spare)
        removed_kv, _ = self.adopt_after_removal()
        assert freed == removed_kv
        if spare >= SPARE_PINNED or n <= unpinned:
            assert pinned <= self.kv_ref, "a pinned state's prefix went before unpinned KV"
        left = self.tree.evictable_kv()
        assert freed >= n or left == (in_pinned if spare >= SPARE_PINNED else 0)
        assert self.st_ref <= self.kv_ref

    def pinned_with_state(self) -> set:
        return {id(p) for p in self.pins if p.state_slot is not None and not p.state_lock}

    def branches_with_state(self) -> set:
        """Unpinned evictable states of branch points (the policy's second tier)."""
        found, stack = set(), list(self.tree.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.branched and not node.wait_pins and node.state_slot is not None:
                if not node.state_lock:
                    found.add(id(node))
        return found

    def do_evict_state(self, n: int, spare: int = SPARE_NOTHING) -> None:
        pinned, branch = self.pinned_with_state(), self.branches_with_state()
        others = self.tree.evictable_state() - len(pinned) - len(branch)
        over = max(0, len(branch) - self.tree.policy.branch_cap)  # goes first, whatever spared
        freed = self.tree.evict_state(n, spare)
        _, removed_states = self.adopt_after_removal()
        assert freed == removed_states
        pinned_left, branch_left = self.pinned_with_state(), self.branches_with_state()
        if spare >= SPARE_PINNED or n <= others + len(branch):
            assert pinned_left == pinned, "a pinned state went before the unpinned ones"
        if spare >= SPARE_SHARED or n <= others + over:
            assert len(branch - branch_left) <= over, "a branch point went before the others"
        if freed < n:  # nothing left that may go
            kept = {SPARE_NOTHING: 0, SPARE_PINNED: len(pinned_left)}.get(
                spare, len(pinned_left) + len(branch_left)
            )
            assert self.tree.evictable_state() == kept

    # ---------------------------------------------------------------- rules

    @rule(data=st.data(), with_state=st.booleans())
    def insert(self, data, with_state: bool) -> None:
        tokens = self.draw_tokens(data)
        self.remember(tokens)
        kv = self.alloc_kv(len(tokens))
        if kv is None:
            return
        slot = self.alloc_state() if with_state else None
        expected_existing = self.ref_kv_len(tokens)
        expect_attach = slot is not None and tuple(tokens) not in self.st_ref
        res = self.tree.insert(tokens, kv, slot)
        assert res.existing_len == expected_existing
        assert res.state_attached == expect_attach
        assert res.inserted_len == (len(tokens) if slot is not None else expected_existing)
        assert res.node.depth == res.inserted_len
        self.add_ref(tokens, res.inserted_len, expect_attach)
        if slot is not None and not res.state_attached:
            self.state_pool.free([slot])
        self.kv_pool.free(kv[res.inserted_len :])

    @rule(data=st.data(), cut=st.integers(-1, 12))
    def lookup(self, data, cut: int) -> None:
        tokens = self.draw_tokens(data)
        limit = None if cut > len(tokens) else cut
        nodes = self.tree.num_nodes()
        m = self.tree.match(tokens, limit)
        assert m.kv_len == self.ref_kv_len(tokens)
        ref_limit = len(tokens) if limit is None else limit
        assert m.prefix_len == self.ref_prefix_len(tokens, ref_limit)
        assert m.node.depth == m.prefix_len and self.tree.num_nodes() == nodes
        assert torch.equal(m.kv_slots, self.tree.path_kv(m.node))

    @precondition(lambda self: len(self.reqs) < MAX_LIVE)
    @rule(data=st.data())
    def start_request(self, data) -> None:
        tokens = self.draw_tokens(data)
        self.remember(tokens)
        m = self.tree.match(tokens, limit=len(tokens) - 1)
        assert m.prefix_len == self.ref_prefix_len(tokens, len(tokens) - 1)
        assert m.kv_len == self.ref_kv_len(tokens)
        self.tree.lock(m.node)
        if m.prefix_len:
            self.tree.lock_state(m.node)
        self.reqs.append(Req(tokens, m.node, m.prefix_len, m.kv_slots, m.prefix_len > 0))

    @precondition(lambda self: any(r.own_kv is None for r in self.reqs))
    @rule(i=st.integers(0, MAX_LIVE - 1))
    def compute_request(self, i: int) -> None:
        waiting = [r for r in self.reqs if r.own_kv is None]
        r = waiting[i % len(waiting)]
        own = self.alloc_kv(len(r.tokens) - r.prefix_len)
        state = self.alloc_state() if own is not None else None
        if own is None or state is None:
            if own is not None:
                self.kv_pool.free(own)
            self.abort(r)
            return
        r.own_kv, r.state = own, state
        if r.state_locked:  # the resume copy has run
            self.tree.unlock_state(r.node)
            r.state_locked = False

    @precondition(lambda self: any(r.own_kv is not None for r in self.reqs))
    @rule(i=st.integers(0, MAX_LIVE - 1))
    def finish_request(self, i: int) -> None:
        done = [r for r in self.reqs if r.own_kv is not None]
        r = done[i % len(done)]
        kv = torch.cat([r.prefix_kv, r.own_kv])
        expected_existing = self.ref_kv_len(r.tokens)
        expect_attach = tuple(r.tokens) not in self.st_ref
        res = self.tree.insert(r.tokens, kv, r.state, owned_from=r.prefix_len)
        assert res.existing_len == expected_existing >= r.prefix_len
        assert res.state_attached == expect_attach and res.inserted_len == len(r.tokens)
        self.add_ref(r.tokens, len(r.tokens), expect_attach)
        if not res.state_attached:
            self.state_pool.free([r.state])
        r.own_kv, r.state = None, None
        self.reqs.remove(r)
        self.tree.unlock(r.node)
        self.adopt_after_removal()

    @precondition(lambda self: bool(self.reqs))
    @rule(i=st.integers(0, MAX_LIVE - 1))
    def abort_request(self, i: int) -> None:
        self.abort(self.reqs[i % len(self.reqs)])

    def abort(self, r: Req) -> None:
        if r.own_kv is not None:
            self.kv_pool.free(r.own_kv)
            self.state_pool.free([r.state])
        if r.state_locked:
            self.tree.unlock_state(r.node)
        self.reqs.remove(r)
        self.tree.unlock(r.node)
        self.adopt_after_removal()

    @rule(data=st.data())
    def pin(self, data) -> None:
        m = self.tree.match(self.draw_tokens(data))
        if m.prefix_len:
            self.tree.pin_state(m.node)
            self.pins.append(m.node)

    @rule(i=st.integers(0, 7))
    def unpin(self, i: int) -> None:
        if i < len(self.pins):
            self.tree.unpin_state(self.pins.pop(i))

    @rule(data=st.data())
    def mark_branch(self, data) -> None:
        m = self.tree.match(self.draw_tokens(data))
        if m.prefix_len:
            self.tree.mark_branch(m.node)

    @rule(n=st.integers(1, 4), spare=st.sampled_from([SPARE_PINNED, SPARE_SHARED]))
    def evict_state_sparing(self, n: int, spare: int) -> None:
        self.do_evict_state(n, spare)

    @rule(n=st.integers(1, 24), spare=st.sampled_from([SPARE_NOTHING, SPARE_PINNED]))
    def evict_kv(self, n: int, spare: int) -> None:
        self.do_evict_kv(n * self.PAGE if n > 12 else n, spare)

    @rule(n=st.integers(1, 4))
    def evict_state(self, n: int) -> None:
        self.do_evict_state(n)

    # ---------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        held_kv = [s for r in self.reqs if r.own_kv is not None for s in r.own_kv.tolist()]
        held_state = [r.state for r in self.reqs if r.state is not None]
        self.tree.check_integrity(held_kv=held_kv, held_state=held_state)
        assert content(self.tree) == (self.kv_ref, self.st_ref)

    def teardown(self) -> None:
        for r in list(self.reqs):
            self.abort(r)
        for node in self.pins:
            self.tree.unpin_state(node)
        self.tree.evict_kv(10**9)
        self.tree.evict_state(10**9)
        self.tree.check_integrity()
        assert self.tree.num_nodes() == 0
        assert self.kv_pool.available() == self.kv_pool.size
        assert self.state_pool.available() == self.state_pool.size


class PagedRadixMachine(RadixMachine):
    PAGE = 16


class ValueRadixMachine(RadixMachine):
    """The same rules and checks over the ``value`` state policy (its tiers and spares are the
    LRU policy's; its order within a tier is checked by its own ``check``)."""

    POLICY = "value"


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


TestRadixStateful = RadixMachine.TestCase
TestRadixStateful.settings = _settings(250)
TestRadixStatefulPaged = PagedRadixMachine.TestCase
TestRadixStatefulPaged.settings = _settings(150)  # slower steps: 16x the slots per token run
TestRadixStatefulValue = ValueRadixMachine.TestCase
TestRadixStatefulValue.settings = _settings(150)
