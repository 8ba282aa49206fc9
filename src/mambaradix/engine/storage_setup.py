"""Wiring of the storage tier (``cache.storage``) from the engine's flags."""

from __future__ import annotations

import logging
import os
import time

import torch

from mambaradix.cache.storage.backend import create_storage_backend
from mambaradix.cache.storage.keys import model_fingerprint
from mambaradix.cache.storage.tier import StorageTier
from mambaradix.config import EngineConfig
from mambaradix.engine.cpu_runtime import serial_torch_thread
from mambaradix.engine.planner import snapshot_alignment

logger = logging.getLogger(__name__)

DEFAULT_DIR = os.path.join("~", ".cache", "mambaradix", "hicache")
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def storage_location(cfg: EngineConfig) -> str:
    if cfg.hicache_storage_backend == "redis":
        return cfg.hicache_storage_url or DEFAULT_REDIS_URL
    return os.path.expanduser(cfg.hicache_storage_dir or DEFAULT_DIR)


def make_storage_tier(
    cfg: EngineConfig, model: torch.nn.Module, kv_pool: object, state_pool: object
) -> StorageTier | None:
    """The engine's storage tier, or None when ``--enable-hierarchical-cache`` is off. Objects
    are blocks of one snapshot alignment (whole pages), keyed under the model's fingerprint."""
    if not cfg.enable_hierarchical_cache:
        return None
    capacity = int(cfg.hicache_size * (1 << 30))
    where = storage_location(cfg)
    if cfg.hicache_storage_backend == "redis":
        backend = create_storage_backend("redis", url=where, capacity_bytes=capacity)
    else:
        backend = create_storage_backend("file", root=where, capacity_bytes=capacity)
    block = snapshot_alignment(cfg.page_size)
    t0 = time.perf_counter()
    fingerprint = model_fingerprint(
        model, model.kv_spec, model.state_spec, block=block, page_size=cfg.page_size
    )
    logger.info(
        "storage tier: %s at %s, %s, block %d tokens, bound %s, model fingerprint %s (%.0f ms)",
        backend.name, where, cfg.hicache_write_policy, block,
        f"{cfg.hicache_size:g} GB" if capacity else "none", fingerprint,
        1e3 * (time.perf_counter() - t0),
    )  # fmt: skip
    return StorageTier(
        backend,
        kv_pool=kv_pool,
        state_pool=state_pool,
        block=block,
        fingerprint=fingerprint,
        write_policy=cfg.hicache_write_policy,
        thread_init=serial_torch_thread,
    )
