"""The ``value`` state eviction policy (``cache/evict_policy.py``): GreedyDual by the tokens a
state saves. Its tiers and spares are the LRU policy's (the tier tests of test_radix.py and the
stateful machine run over both); these tests pin down its order within a tier, each with the
LRU policy as the control that orders differently."""

from __future__ import annotations

import random

import pytest
from test_radix_helpers import make_tree, put, seq


def _states(tree) -> set[int]:
    return {id(n) for n in tree.policy.members(10**6)}


@pytest.mark.parametrize(("policy", "order"), [("value", [2, 4, 8]), ("lru", [8, 2, 4])])
def test_the_shallowest_state_goes_first(policy, order):
    tree, *_ = make_tree(state_policy=policy)
    nodes = {n: put(tree, seq(100 * n, 100 * n + n - 1)).node for n in (8, 2, 4)}
    gone = []
    for _ in range(3):
        before = {id(node): depth for depth, node in nodes.items()}
        assert tree.evict_state(1) == 1
        left = _states(tree)
        gone += [depth for key, depth in before.items() if key not in left and depth not in gone]
        tree.check_integrity()
    assert gone == order


@pytest.mark.parametrize(("policy", "survives"), [("value", range(20, 100)), ("lru", [0])])
def test_an_unused_deep_state_ages_out(policy, survives):
    """A 64-token state nobody uses again outlives many turnovers of the three other slots'
    4-token states while the clock climbs to its priority (33 evictions: the clock gains about
    two a turnover), then goes: the value ages, it is not a permanent pin. LRU frees it
    first."""
    tree, *_ = make_tree(kv_size=512, state_size=4, state_policy=policy)
    deep = put(tree, seq(1000, 1063)).node
    for k in range(3):
        put(tree, seq(10 * k, 10 * k + 3))
    evictions = 0
    while deep.state_slot is not None and evictions < 100:
        assert tree.evict_state(1) == 1
        tree.check_integrity()
        if deep.state_slot is not None:
            evictions += 1
            put(tree, seq(100 + 10 * evictions, 100 + 10 * evictions + 3))
    assert deep.state_slot is None and evictions in survives


@pytest.mark.parametrize("policy", ["value", "lru"])
def test_a_use_renews_the_priority(policy):
    """Of two states of one depth the one used since goes last, under both policies; under
    ``value`` a use after the clock moved lifts it above states added before."""
    tree, *_ = make_tree(state_size=8, state_policy=policy)
    a = put(tree, seq(10, 13)).node
    b = put(tree, seq(20, 23)).node
    assert tree.match(seq(10, 13) + [99]).node is a  # a use of a
    assert tree.evict_state(1) == 1 and b.state_slot is None and a.state_slot is not None
    tree.check_integrity()


@pytest.mark.parametrize(("policy", "hit"), [("value", 16 + 32 + 64), ("lru", 0)])
def test_sessions_coming_back_in_turn_keep_the_deepest(policy, hit):
    """Five sessions (4, 8, 16, 32 and 64 tokens) come back in turn to a pool of four states:
    LRU frees each one just before its turn and hits nothing (its cyclic worst case); value
    keeps the three deepest, which then hit every round."""
    depths = (4, 8, 16, 32, 64)
    tree, *_ = make_tree(kv_size=512, state_size=4, state_policy=policy)
    sessions = [seq(1000 * (i + 1), 1000 * (i + 1) + d - 1) for i, d in enumerate(depths)]
    hits = []
    for _ in range(4):
        hits.append(0)
        for tokens in sessions:
            m = tree.match(tokens + [7])
            hits[-1] += m.prefix_len
            if m.prefix_len < len(tokens):
                if tree.state_pool.available() == 0:
                    assert tree.evict_state(1) == 1
                put(tree, tokens)
            tree.check_integrity()
    assert hits[0] == 0 and hits[2:] == [hit, hit]


def test_the_victim_is_the_lowest_priority_a_reference_gives():
    """Random adds, uses and evictions on states of random depths in one tier (no shared
    prefixes: no branch points), against a reference of the policy: priority = the clock at
    the last add or use + depth, ties to the earlier one; an eviction raises the clock to the
    victim's priority, an add by its depth over the pool's slots."""
    rng = random.Random(0)
    slots = 12
    tree, *_ = make_tree(kv_size=4096, state_size=slots, state_policy="value")
    ref: dict[int, tuple[int, int]] = {}  # first token -> (priority, order)
    clock, order = 0, 0
    tokens_of: dict[int, list[int]] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.4 and tree.state_pool.available():
            first = 10_000 + step
            tokens = [first, *rng.sample(range(1, 9000), rng.randint(0, 40))]
            put(tree, tokens)
            order += 1
            ref[first], tokens_of[first] = (clock + len(tokens), order), tokens
            clock += len(tokens) // slots
        elif op < 0.7 and ref:
            first = rng.choice(sorted(ref))
            tokens = tokens_of[first]
            assert tree.match(tokens + [9999]).prefix_len == len(tokens)
            order += 1
            ref[first] = (clock + len(tokens), order)
        elif ref:
            want = min(ref, key=ref.__getitem__)
            assert tree.evict_state(1) == 1
            left = {n.key[0] for n in tree.policy.members(10**6)}
            assert set(ref) - left == {want}
            clock = max(clock, ref.pop(want)[0])
        tree.check_integrity()
    assert tree.policy.clock == clock > 0


def test_the_flag_offers_every_registered_policy():
    import dataclasses

    from mambaradix.cache.evict_policy import STATE_POLICIES
    from mambaradix.config import EngineConfig

    field = {f.name: f for f in dataclasses.fields(EngineConfig)}["state_eviction_policy"]
    assert sorted(field.metadata["choices"]) == sorted(STATE_POLICIES)
    assert field.default in STATE_POLICIES
