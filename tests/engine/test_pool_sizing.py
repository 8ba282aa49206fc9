"""engine/pools.py: the pool sizes, running cap and strategy the engine picks at start, from
the state-slot and KV arithmetic of published model shapes (built on the meta device: no
weights, no memory)."""

from __future__ import annotations

import pytest
import torch

from mambaradix.config import EngineConfig
from mambaradix.engine.pools import (
    AUTO_MIN_RUNNING,
    EXTRA_BUFFER,
    NO_BUFFER,
    RUNNING_SHARE,
    GiB,
    model_weight_bytes,
    size_pools,
)
from mambaradix.models.published import get_published
from mambaradix.models.registry import get_model_class
from mambaradix.models.weights import no_init

MiB = 1 << 20
_SHAPES: dict[str, torch.nn.Module] = {}


def shaped(name: str) -> torch.nn.Module:
    """Our model of a published config on the meta device, in bf16 (states: fp32)."""
    if name not in _SHAPES:
        pub = get_published(name)
        config = pub.config()
        config.architectures = [pub.model_class]
        with no_init():
            model = get_model_class(config.architectures)(config, ssm_dtype=torch.float32)
        _SHAPES[name] = model.to(dtype=torch.bfloat16)
    return _SHAPES[name]


def sizing(name: str, available: int | None = None, **flags):
    model = shaped(name)
    return size_pools(
        EngineConfig(**flags),
        model.kv_spec.bytes_per_token(),
        model.state_spec,
        model_weight_bytes(model),
        available=available,
    )


def test_slot_and_kv_bytes_of_qwen3_5_0_8b():
    """18 GDN layers: conv state [2*16*128 + 16*128, 3] bf16 + temporal [16, 128, 128] fp32;
    6 attention layers: K and V of 2 heads x 256 in bf16 per token."""
    model = shaped("qwen3_5_0_8b")
    conv = (2 * 16 * 128 + 16 * 128) * 3 * 2
    temporal = 16 * 128 * 128 * 4
    assert model.state_spec.slot_bytes() == 18 * (conv + temporal) == 19_537_920
    assert model.kv_spec.bytes_per_token() == 6 * 2 * 2 * 256 * 2


def test_slot_bytes_of_granite_and_lfm2():
    granite = shaped("granite_4_0_h_1b")  # 36 Mamba2 layers, 48 heads x 64, d_state 128
    conv = (48 * 64 + 2 * 128) * 3 * 2
    assert granite.state_spec.slot_bytes() == 36 * (conv + 48 * 64 * 128 * 4)
    lfm2 = shaped("lfm2_350m")  # 10 short-conv layers, no temporal state
    assert lfm2.state_spec.slot_bytes() == 10 * 1024 * 2 * 2


def test_budget_split_by_the_memory_ratio():
    """slots = budget x r / (1 + r) // slot bytes; tokens = budget / (1 + r) // KV bytes."""
    model = shaped("qwen3_5_0_8b")
    slot, kv = model.state_spec.slot_bytes(), model.kv_spec.bytes_per_token()
    p = sizing("qwen3_5_0_8b", available=20 * GiB, page_size=16)
    budget = 0.5 * 20 * GiB
    assert p.budget_bytes == budget
    assert p.state_slots == int(budget * 0.5 / 1.5 // slot)
    want_tokens = int(budget / 1.5 // kv)
    assert p.kv_tokens == want_tokens - want_tokens % 16  # whole pages
    q = sizing("qwen3_5_0_8b", available=20 * GiB, mamba_full_memory_ratio=1.0)
    assert q.state_slots == int(budget / 2 // slot)
    r = sizing("qwen3_5_0_8b", available=1, mem_budget_gb=3.0)  # the budget flag wins
    assert r.budget_bytes == 3 * GiB


@pytest.mark.parametrize("slots", [127, 128])
def test_auto_strategy_rule(slots):
    """extra_buffer iff 75% of the slots hold AUTO_MIN_RUNNING requests at 3 slots each."""
    p = sizing("qwen3_5_0_8b", available=64 * GiB, max_mamba_cache_size=slots)
    fits = int(slots * RUNNING_SHARE) // 3 >= AUTO_MIN_RUNNING
    assert fits == (slots >= 128)
    assert p.strategy == (EXTRA_BUFFER if fits else NO_BUFFER)
    per_req = 3 if p.strategy == EXTRA_BUFFER else 1
    assert p.max_running == int(slots * RUNNING_SHARE) // per_req


@pytest.mark.parametrize(
    "name",
    ["qwen3_5_0_8b", "qwen3_5_2b", "lfm2_350m", "lfm2_1_2b", "lfm2_2_6b",
     "granite_4_0_h_350m", "granite_4_0_h_1b"],
)  # fmt: skip
def test_default_on_a_24_gb_machine_runs_32_requests_with_room_for_snapshots(name):
    """A 0.35B-3B model on a 24 GB machine (1 GB left to the system, the weights in bf16):
    the defaults run at least 32 requests and keep a quarter of the slots for snapshots."""
    weights = model_weight_bytes(shaped(name))
    p = sizing(name, available=24 * GiB - weights - 1 * GiB)
    per_req = 3 if p.strategy == EXTRA_BUFFER else 1
    assert p.max_running >= 32, p.describe()
    assert p.state_slots - p.max_running * per_req >= (1 - RUNNING_SHARE) * p.state_slots - 1
    assert p.kv_tokens >= 32 * 2048, p.describe()  # 32 requests of 2k tokens fit in the KV
    print(f"\n{name}\n{p.describe()}")


def test_explicit_sizes_win():
    p = sizing(
        "qwen3_5_0_8b",
        available=64 * GiB,
        max_mamba_cache_size=40,
        max_total_tokens=8192,
        max_running_requests=12,
        mamba_scheduler_strategy="extra_buffer",
    )
    assert (p.state_slots, p.kv_tokens, p.max_running, p.strategy) == (
        40,
        8192,
        12,
        EXTRA_BUFFER,
    )


def test_too_little_memory_is_a_clear_error():
    with pytest.raises(ValueError, match="--mem-fraction-static.*--max-mamba-cache-size"):
        sizing("qwen3_5_0_8b", available=200 * MiB)  # 100 MB budget: not 16 slots of 18.6 MB
    with pytest.raises(ValueError, match="--max-total-tokens"):
        # 30 MB budget, one explicit slot: not the 4,096-token minimum of 12 KB each
        sizing("qwen3_5_0_8b", available=60 * MiB, max_mamba_cache_size=1)
    # explicit slots fit the budget, but what they leave does not hold the KV minimum: an
    # error, not pools larger than the budget
    p = sizing("qwen3_5_0_8b", available=64 * GiB, mem_budget_gb=0.5)
    slots = int((p.budget_bytes - 2048 * p.kv_bytes_per_token) // p.slot_bytes)
    assert slots * p.slot_bytes < p.budget_bytes
    with pytest.raises(ValueError, match="--max-mamba-cache-size .* leaves .* lower it"):
        sizing("qwen3_5_0_8b", available=64 * GiB, mem_budget_gb=0.5, max_mamba_cache_size=slots)
    fits = sizing("qwen3_5_0_8b", available=64 * GiB, mem_budget_gb=0.5,
                max_mamba_cache_size=slots - 3)  # fmt: skip
    assert fits.pool_bytes <= fits.budget_bytes
    with pytest.raises(ValueError, match="--max-running-requests 20 needs 60 state slots"):
        sizing(
            "qwen3_5_0_8b",
            available=64 * GiB,
            max_mamba_cache_size=40,
            max_running_requests=20,
            mamba_scheduler_strategy="extra_buffer",
        )


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", [NO_BUFFER, EXTRA_BUFFER])
def test_running_cap_counts_the_verify_steps_slots(k, strategy):
    """With speculation a running request holds k more state slots (the states after each
    draft token of a verify step): the cap divides the running share by 1 + k or 3 + k."""
    flags = dict(max_mamba_cache_size=200, mamba_scheduler_strategy=strategy)
    p = sizing("qwen3_5_0_8b", available=64 * GiB, **flags)
    q = sizing("qwen3_5_0_8b", available=64 * GiB, speculative_algorithm="NGRAM",
             speculative_num_steps=k, **flags)  # fmt: skip
    per_req = 3 if strategy == EXTRA_BUFFER else 1
    assert p.max_running == int(200 * RUNNING_SHARE) // per_req
    assert q.max_running == int(200 * RUNNING_SHARE) // (per_req + k)
    print(f"k={k} {strategy}: {per_req + k} slots x {q.slot_bytes / (1 << 20):.1f} MB a request")
