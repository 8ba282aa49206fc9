"""Pools on the host cost memory only where they are written (``cache/host_memory.py``): a
large pool maps zero pages the kernel supplies on first touch, so start-up does not fault in a
budget it may never use; small or non-CPU tensors are ordinary ``torch.zeros``."""

from __future__ import annotations

import os

import torch

from mambaradix.cache.host_memory import MAPPED_MIN_BYTES, lazy_zeros
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec

MB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_pool_is_resident_only_where_written():
    before = rss()
    pool = lazy_zeros((64, 1 << 20), torch.float32)  # 256 MB
    assert rss() - before < 16 * MB
    assert pool.shape == (64, 1 << 20) and pool.dtype == torch.float32
    assert pool[::8, ::4096].abs().sum() == 0  # zero where read (one float per page)
    pool[3].fill_(2.0)  # 4 MB written
    assert pool[3].sum() == 2.0 * (1 << 20) and pool[4].sum() == 0
    assert rss() - before < 32 * MB
    # the control: writing every page makes them resident. (Not a fresh torch.zeros: in a
    # worker whose earlier tests freed hundreds of MB, malloc hands back pages already resident)
    pool.fill_(1.0)
    assert rss() - before > 200 * MB


def test_small_and_bf16_pools():
    small = lazy_zeros((4, 16), torch.bfloat16)
    assert small.shape == (4, 16) and small.dtype == torch.bfloat16 and small.sum() == 0
    assert small.numel() * 2 < MAPPED_MIN_BYTES
    big = lazy_zeros((1024, 1024), torch.bfloat16)  # 2 MB: mapped
    big[5, 7] = 1.5
    assert big.sum() == 1.5 and big.dtype == torch.bfloat16


def test_pools_allocate_lazily():
    before = rss()
    kv = KVPool(KVSpec(num_layers=4, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16), 1 << 16)
    layer = StateLayerSpec(conv_shape=(4096, 3), temporal_shape=(32, 128, 128))
    states = StatePool(StateSpec([layer] * 4), 64)  # 4 x 64 x 2 MB of temporal state
    assert kv.k[0].shape == (1 << 16, 4, 128)
    assert rss() - before < 64 * MB  # ~770 MB of pools declared
    slots = states.alloc(1)
    states.temporal[0][slots[0]].fill_(1.0)
    assert states.temporal[0][slots[0]].sum() == 32 * 128 * 128
