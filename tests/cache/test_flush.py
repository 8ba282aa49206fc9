"""Flushing the prefix cache (``/flush_cache``): every slot goes back to the pools, the tree is
left with its root only, and a flush is refused, freeing nothing, while a request is live."""

from __future__ import annotations

import pytest

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.request_cache import RequestCache
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec

SPEC = StateSpec((StateLayerSpec(conv_shape=(2, 3), temporal_shape=(1, 2, 2)),))


def make(strategy: str, page: int = 1) -> RequestCache:
    return RequestCache(
        KVPool(KVSpec(1, 1, 1), 512, page), StatePool(SPEC, 16), ReqSlots(4, 256),
        strategy=strategy,
    )  # fmt: skip


def finish(cache: RequestCache, tokens: list[int]) -> None:
    rc, _ = cache.admit(cache.match(tokens), len(tokens))
    cache.resume_done(rc)
    cache.finish(rc, tokens, len(tokens))
    cache.check_integrity()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
@pytest.mark.parametrize("page", [1, 4])
def test_flush_empties_tree_and_returns_every_slot(strategy, page):
    cache = make(strategy, page)
    base = list(range(1, 65))
    for tail in ([100, 101, 102, 103], [200, 201, 202, 203, 204, 205, 206, 207], []):
        finish(cache, base + tail)
    tree = cache.tree
    assert tree.num_nodes() >= 2 and tree.total_kv() > 0 and tree.total_state() > 0
    held_kv = tree.total_kv()
    assert cache.flush() == held_kv
    assert tree.num_nodes() == 0 and tree.total_kv() == 0 and tree.total_state() == 0
    assert not tree.root.children
    assert cache.kv_pool.available() == cache.kv_pool.size
    assert cache.state_pool.available() == cache.state_pool.size
    cache.check_integrity()
    assert cache.match(base + [100]).prefix_len == 0  # nothing cached any more
    finish(cache, base)  # the tree works after a flush
    assert cache.match(base + [1]).prefix_len > 0


def test_flush_refused_while_a_request_is_live():
    cache = make("extra_buffer")
    base = list(range(1, 65))
    finish(cache, base)
    before = (cache.tree.num_nodes(), cache.tree.total_kv(), cache.kv_pool.available())
    rc, _ = cache.admit(cache.match(base + [7, 8]), 66)  # holds the cached prefix
    assert cache.flush() is None
    assert (cache.tree.num_nodes(), cache.tree.total_kv()) == before[:2]
    cache.check_integrity()
    cache.resume_done(rc)
    cache.release(rc)
    assert cache.flush() == before[1]
    cache.check_integrity()


def test_tree_flush_refused_while_locked_negative_control():
    """The tree itself refuses while a node is locked (a check that could pass vacuously)."""
    cache = make("extra_buffer")
    finish(cache, list(range(1, 65)))
    tree = cache.tree
    node = tree.match(list(range(1, 65))).node
    tree.lock(node)
    assert tree.flush() is None and tree.num_nodes() > 0
    tree.unlock(node)
    assert tree.flush() and tree.num_nodes() == 0


def test_flush_with_cache_disabled_is_a_no_op():
    cache = RequestCache(
        KVPool(KVSpec(1, 1, 1), 64, 1), StatePool(SPEC, 4), ReqSlots(2, 64), enabled=False
    )
    assert cache.flush() == 0
