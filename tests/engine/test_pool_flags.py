"""Pool sizing flags (``engine.pools.size_pools`` on a synthetic state spec; the published
shapes are in test_pool_sizing.py): the memory budget from ``--mem-budget-gb`` or
``--mem-fraction-static`` of the free memory, its split by ``--mamba-full-memory-ratio``,
explicit sizes winning, the running cap, the ``auto`` strategy, and the errors that name the
flags to change. Pure arithmetic over the sizing: no engine is built."""

from __future__ import annotations

import pytest

from mambaradix.config import EngineConfig
from mambaradix.core import StateLayerSpec, StateSpec
from mambaradix.engine.pools import MAX_RUNNING, RUNNING_SHARE, GiB, size_pools

SPEC = StateSpec((StateLayerSpec(conv_shape=(64, 3), temporal_shape=(8, 16, 16)),) * 4)
SLOT = SPEC.slot_bytes()
KV = 4096  # bytes per token


def sizing(available: int = 8 * GiB, **flags):
    return size_pools(EngineConfig(**flags), KV, SPEC, available=available)


def test_fraction_of_the_free_memory():
    p = sizing(available=2 * GiB, mem_fraction_static=0.25)
    assert p.budget_bytes == 0.5 * GiB and "--mem-fraction-static" in p.budget_source
    assert sizing(available=4 * GiB, mem_fraction_static=0.25).kv_tokens == 2 * p.kv_tokens


def test_explicit_sizes_win():
    p = sizing(mem_budget_gb=0.25, max_mamba_cache_size=40)
    assert p.state_slots == 40
    assert p.kv_tokens == int((0.25 * GiB - 40 * SLOT) // KV)  # KV takes the rest
    p = sizing(max_mamba_cache_size=40, max_total_tokens=5000, page_size=16)
    assert (p.state_slots, p.kv_tokens) == (40, 5000 // 16 * 16)  # whole pages


def test_running_cap_and_auto_strategy():
    big = sizing(max_mamba_cache_size=400)
    assert big.strategy == "extra_buffer"  # 300 slots for running requests: 100 at 3 each
    assert big.max_running == int(400 * RUNNING_SHARE) // 3
    small = sizing(max_mamba_cache_size=64)
    assert small.strategy == "no_buffer"  # 48 // 3 = 16 < 32 requests: 1 slot each instead
    assert small.max_running == int(64 * RUNNING_SHARE)
    assert sizing(max_mamba_cache_size=4000, mamba_scheduler_strategy="no_buffer").max_running == (
        MAX_RUNNING
    )
    asked = sizing(max_mamba_cache_size=400, max_running_requests=120)
    assert asked.strategy == "no_buffer" and asked.max_running == 120  # 120 * 3 > 300
    off = sizing(max_mamba_cache_size=64, disable_radix_cache=True)
    assert off.max_running == int(64 * RUNNING_SHARE)  # 1 slot per request, no snapshots


def test_errors_name_the_flags():
    with pytest.raises(ValueError, match="--max-mamba-cache-size"):
        sizing(mem_budget_gb=SLOT * 8 / GiB)  # not even 16 state slots
    with pytest.raises(ValueError, match="--max-total-tokens"):
        sizing(mem_budget_gb=(20 * SLOT + 100 * KV) / GiB, max_mamba_cache_size=20)
    with pytest.raises(ValueError, match="--max-running-requests 30 needs 90"):
        sizing(max_mamba_cache_size=64, max_running_requests=30,
             mamba_scheduler_strategy="extra_buffer")  # fmt: skip


def test_storage_flags_of_the_other_backend_are_refused():
    """A storage flag the chosen backend would ignore is an error, not a silent no-op."""
    with pytest.raises(ValueError, match="--hicache-storage-url is for"):
        EngineConfig(enable_hierarchical_cache=True, hicache_storage_url="redis://x").validate()
    with pytest.raises(ValueError, match="--hicache-storage-dir is for"):
        EngineConfig(
            enable_hierarchical_cache=True, hicache_storage_backend="redis", hicache_storage_dir="d"
        ).validate()
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        EngineConfig(hicache_size=1.0).validate()
    EngineConfig(enable_hierarchical_cache=True, hicache_storage_dir="d").validate()  # control
