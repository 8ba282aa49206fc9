"""Shared helpers of the engine tests (fake-model engines, step-by-step schedulers)."""

from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from fake_model import FakeModel  # noqa: E402

from mambaradix.engine.engine import Engine  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 4}


def fake_engine(**flags) -> Engine:
    """Engine over the fake model with the integrity check after every step."""
    flags.setdefault("max_total_tokens", 32768)
    flags.setdefault("max_mamba_cache_size", 256)
    eos = flags.pop("eos", None)
    return Engine(model=FakeModel(eos), tokenizer=None, debug_integrity=True, **flags)


def rand_tokens(rng: random.Random, n: int, vocab: int = 61) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def new_req(rid: str, ids: list[int], n: int = 4, **params):
    """A greedy request of ``n`` new tokens for a step-driven scheduler (``params``: more
    ``SamplingParams`` fields)."""
    from mambaradix.core import SamplingParams
    from mambaradix.engine.request import Req

    return Req(
        rid=rid, prompt_ids=ids, params=SamplingParams(max_new_tokens=n, temperature=0.0, **params)
    )


def make_scheduler(model=None, **flags):
    """A scheduler driven step by step in the test's thread (no engine loop)."""
    from mambaradix.cache.kv_pool import KVPool
    from mambaradix.cache.req_slots import ReqSlots
    from mambaradix.cache.request_cache import RequestCache
    from mambaradix.cache.state_pool import StatePool
    from mambaradix.config import EngineConfig
    from mambaradix.core import EXTRA_BUFFER
    from mambaradix.engine.runner import ModelRunner
    from mambaradix.engine.scheduler import Scheduler

    model = model or FakeModel()
    kv_tokens = flags.pop("max_total_tokens", 8192)
    slots = flags.pop("max_mamba_cache_size", 64)
    max_running = flags.pop("max_running_requests", 8)
    cfg = EngineConfig(**flags).with_device_defaults()
    strategy = cfg.mamba_scheduler_strategy
    strategy = EXTRA_BUFFER if strategy == "auto" else strategy
    kv = KVPool(model.kv_spec, kv_tokens, cfg.page_size)
    st = StatePool(model.state_spec, slots)
    cache = RequestCache(
        kv, st, ReqSlots(max_running, 4096), enabled=not cfg.disable_radix_cache, strategy=strategy
    )
    runner = ModelRunner(model, kv, st)
    sched = Scheduler(
        cfg,
        cache,
        runner,
        eos_token_ids=model.eos_token_ids,
        context_length=4096,
        max_running=max_running,
    )
    return sched


def run_to_end(sched, max_steps: int = 10_000) -> int:
    steps = 0
    while not sched.is_idle():
        sched.step()
        sched.check_integrity()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    sched.runner.shutdown()
    return steps


def assert_all_free(sched) -> None:
    """Once idle and the tree is evicted, both pools are entirely free."""
    cache = sched.cache
    if cache.tree is not None:
        cache.tree.evict_kv(cache.kv_pool.size)
        cache.tree.evict_state(cache.state_pool.size)
    cache.check_integrity()
    assert cache.kv_pool.available() == cache.kv_pool.size
    assert cache.state_pool.available() == cache.state_pool.size
    assert cache.req_slots.available() == cache.req_slots.num_rows
