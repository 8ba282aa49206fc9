"""Host memory (``host_memory.py``). Pools cost memory only where they are written: a large
pool maps zero pages the kernel supplies on first touch, so start-up does not fault in a budget
it may never use; small or non-CPU tensors are ordinary ``torch.zeros``. Weights are cut from
one arena advised for transparent huge pages."""

from __future__ import annotations

import os

import pytest
import torch

from mambaradix import host_memory
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec
from mambaradix.host_memory import ALIGN, HUGE_PAGE, MAPPED_MIN_BYTES, WeightArena, lazy_zeros

MB = 1 << 20
THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")  # the kernel has them


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


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of the mapping of this process that holds ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_weight_arena_cuts_aligned_tensors_from_one_huge_page_mapping(monkeypatch):
    monkeypatch.setattr(host_memory, "HUGE_PAGES", True)
    shapes = [(1000, 3), (64, 64), (7,), (2048, 1024)]
    arena = WeightArena(sum(WeightArena.span(s, torch.bfloat16) for s in shapes))
    cut = [arena.take(s, torch.bfloat16) for s in shapes]
    assert arena.used == arena.capacity
    assert cut[0].data_ptr() % HUGE_PAGE == 0  # the arena starts on a huge page
    for t, s in zip(cut, shapes):
        assert t.shape == s and t.is_contiguous() and t.data_ptr() % ALIGN == 0
    for i, t in enumerate(cut):  # disjoint: each keeps what was written to it
        t.fill_(i + 1)
    assert [float(t.float().mean()) for t in cut] == [1.0, 2.0, 3.0, 4.0]
    if not THP:  # a kernel without transparent huge pages refuses the advice: said, not hidden
        assert not arena.huge
        return
    assert arena.huge and "hg" in _vm_flags(cut[3].data_ptr())  # advised MADV_HUGEPAGE
    with pytest.raises(ValueError, match="left"):
        arena.take((1,), torch.float32)
    # the control: the same arena with the advice off is not advised
    monkeypatch.setattr(host_memory, "HUGE_PAGES", False)
    plain = WeightArena(4 * MB)
    assert not plain.huge and "hg" not in _vm_flags(plain.take((16,), torch.float32).data_ptr())


def test_loaded_weights_live_in_the_arena():
    """Every parameter the loader materialises on the CPU is cut from one advised mapping."""
    from mambaradix.models.loader import load_model

    model = load_model("tiny:lfm2")
    params = list(model.parameters())
    ptrs = sorted(p.data_ptr() for p in params)
    nbytes = sum(WeightArena.span(p.shape, p.dtype) for p in params)
    assert ptrs[-1] - ptrs[0] < nbytes  # packed one after another
    advised = ["hg" in _vm_flags(p) for p in ptrs[:: max(1, len(ptrs) // 8)]]
    assert all(advised) if THP else not any(advised)
