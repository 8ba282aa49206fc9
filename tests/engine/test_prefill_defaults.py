"""The prefill sizes left at 0 (the defaults) are decided by the device: 512 tokens a request
and 4096 a forward on a CPU, SGLang's by memory on a CUDA device (8192 / 16384 on an H100 or
H200); a size given is kept, and the forward's budget is at least the chunk."""

from __future__ import annotations

import types

import pytest
import torch
from engine_helpers import fake_engine

from mambaradix.config import EngineConfig, prefill_defaults

GIB = 2**30


@pytest.mark.parametrize(
    "device,memory,want",
    [
        ("cpu", None, (512, 4096)),
        ("cuda", 24 * GIB, (2048, 16384)),  # an L4 / 4090
        ("cuda", 35 * GIB, (8192, 16384)),  # (35 GiB itself: SGLang's "under 35" is below it)
        ("cuda:0", int(79.6 * GIB), (8192, 16384)),  # an H100
        ("cuda", int(139.8 * GIB), (8192, 16384)),  # an H200
        ("cuda:1", 180 * GIB, (16384, 16384)),  # a B200
    ],
)
def test_prefill_sizes_by_device(device, memory, want):
    assert prefill_defaults(device, memory) == want


def test_an_engine_decides_the_sizes_left_at_0_and_keeps_the_ones_given():
    """On this CPU: the defaults resolve to 512 / 4096 (what the scheduler then uses);
    a chunk over 4096 raises the forward's budget to it; -1 (no chunking) and given budgets
    stay. Control: the config before resolution holds the 0s the scheduler refuses."""
    assert (EngineConfig().chunked_prefill_size, EngineConfig().max_prefill_tokens) == (0, 0)
    cases = [
        ({}, (512, 4096)),
        ({"chunked_prefill_size": 64}, (64, 4096)),
        ({"chunked_prefill_size": 8192}, (8192, 8192)),
        ({"chunked_prefill_size": -1}, (-1, 4096)),
        ({"max_prefill_tokens": 300}, (512, 300)),
    ]
    for flags, want in cases:
        with fake_engine(**flags) as engine:
            cfg = engine.config
            assert (cfg.chunked_prefill_size, cfg.max_prefill_tokens) == want, flags
            assert engine.scheduler.cfg is cfg
            assert engine.scheduler.builder.chunk == (want[0] if want[0] > 0 else 1 << 62)


def test_a_cuda_config_asks_its_device_for_its_memory(monkeypatch):
    """The CUDA branch's plumbing, without a GPU: the device's total memory (an H200's here,
    a B200's for the control) decides the sizes."""
    asked = []

    def props(device):
        asked.append(device)
        return types.SimpleNamespace(total_memory=memory)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    memory = int(139.8 * GIB)
    cfg = EngineConfig(device="cuda:0").with_device_defaults()
    assert (cfg.chunked_prefill_size, cfg.max_prefill_tokens) == (8192, 16384)
    assert asked == [torch.device("cuda:0")]
    memory = 180 * GIB
    cfg = EngineConfig(device="cuda:0").with_device_defaults()
    assert (cfg.chunked_prefill_size, cfg.max_prefill_tokens) == (16384, 16384)
    given = EngineConfig(device="cuda", chunked_prefill_size=1024, max_prefill_tokens=2048)
    assert given.with_device_defaults() is given and len(asked) == 2  # nothing to ask


@pytest.mark.parametrize("flags", [{"chunked_prefill_size": -2}, {"max_prefill_tokens": -1}])
def test_prefill_sizes_below_their_range_are_refused(flags):
    with pytest.raises(ValueError, match="prefill"):
        EngineConfig(**flags).validate()


def test_the_scheduler_refuses_a_config_with_undecided_sizes():
    """A 0 budget would schedule nothing, silently: a scheduler built on an unresolved config
    fails at once, naming the fix."""
    from mambaradix.engine.scheduler import Scheduler

    with pytest.raises(ValueError, match="with_device_defaults"):
        Scheduler(EngineConfig(), None, None, eos_token_ids=[], context_length=8, max_running=1)
