"""KV pool, state pool: allocation, shortage, pages, copies and clears."""

from __future__ import annotations

import pytest
import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateOps, StateSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2)
STATE = StateSpec(
    layers=(
        StateLayerSpec(conv_shape=(3, 2), temporal_shape=(2, 2, 2)),
        StateLayerSpec(conv_shape=(3, 2)),  # short conv: no temporal state
    )
)


def test_kv_alloc_free_and_shortage_takes_nothing():
    pool = KVPool(SPEC, 8)
    a = pool.alloc(5)
    assert a is not None and len(set(a.tolist())) == 5 and pool.available() == 3
    assert pool.alloc(4) is None and pool.available() == 3  # nothing taken
    b = pool.alloc(3)
    assert set(a.tolist()) | set(b.tolist()) == set(range(8)) and pool.available() == 0
    assert pool.alloc(1) is None
    pool.free(a)
    assert pool.available() == 5 and sorted(pool.free_slot_list()) == sorted(a.tolist())
    assert pool.alloc(0).numel() == 0
    assert pool.k[0].shape == (8, 1, 2) and len(pool.v) == 2


def test_kv_page_allocation_is_whole_pages():
    pool = KVPool(SPEC, 32, page_size=4)
    s = pool.alloc(12)
    pages = s.view(-1, 4)
    assert torch.equal(pages - pages[:, :1], torch.arange(4).expand(3, 4))
    assert bool((pages[:, 0] % 4 == 0).all())
    assert pool.available() == 20
    with pytest.raises(ValueError, match="page"):
        pool.alloc(6)
    assert pool.alloc(24) is None and pool.available() == 20
    pool.free(s[4:8])
    assert pool.available() == 24 and set(pool.free_slot_list()) >= set(s[4:8].tolist())
    with pytest.raises(ValueError):
        KVPool(SPEC, 30, page_size=4)


def test_state_alloc_free_shortage():
    pool = StatePool(STATE, 4)
    a = pool.alloc(3)
    assert len(set(a)) == 3 and pool.available() == 1
    assert pool.alloc(2) is None and pool.available() == 1
    pool.free(a[:2])
    assert pool.available() == 3 and pool.alloc(0) == []
    assert pool.temporal[1] is None and pool.conv[1].shape == (4, 3, 2)
    with pytest.raises(ValueError):
        StatePool(STATE, 0)


def test_state_copy_and_clear_all_layers():
    pool = StatePool(STATE, 4)
    for t in pool.conv + [t for t in pool.temporal if t is not None]:
        t[1].fill_(1.5)
        t[2].fill_(2.5)
    pool.copy([1, 2], [3, 0])
    assert bool((pool.conv[0][3] == 1.5).all()) and bool((pool.temporal[0][0] == 2.5).all())
    assert bool((pool.conv[1][0] == 2.5).all())
    assert pool.copies == 2 and pool.copied_bytes == 2 * pool.slot_bytes
    pool.clear([1])
    assert bool((pool.conv[0][1] == 0).all()) and bool((pool.temporal[0][1] == 0).all())
    assert bool((pool.conv[0][2] == 2.5).all())


def test_state_apply_runs_copies_before_clears():
    pool = StatePool(STATE, 3)
    pool.conv[0][0].fill_(7.0)
    ops = StateOps()
    ops.add_copy(0, 1)
    ops.clear.append(0)
    pool.apply(ops)
    assert bool((pool.conv[0][1] == 7.0).all()) and bool((pool.conv[0][0] == 0).all())
    assert STATE.slot_bytes() == pool.slot_bytes == 4 * (6 + 8 + 6)
