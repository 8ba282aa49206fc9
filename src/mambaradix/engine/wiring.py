"""Wiring an engine's parts: the model and tokenizer, the pools sized from the memory budget,
the request cache (with its storage tier), the kernel backend, the runner (warmed up) and the
scheduler. ``Engine`` (engine.py) is the facade over them."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.request_cache import RequestCache
from mambaradix.cache.state_pool import StatePool
from mambaradix.config import EngineConfig
from mambaradix.engine.cpu_runtime import keep_freed_memory
from mambaradix.engine.cuda_graphs import default_batch_sizes
from mambaradix.engine.pools import PoolSizing, model_weight_bytes, size_pools
from mambaradix.engine.request import Req
from mambaradix.engine.runner import ModelRunner
from mambaradix.engine.scheduler import Scheduler
from mambaradix.engine.speculative import DRAFT_HEAD_ALGORITHMS
from mambaradix.engine.storage_setup import make_storage_tier
from mambaradix.engine.structured import StructuredOutput
from mambaradix.kernels.backend import KernelBackend, choose_backend
from mambaradix.stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    config: EngineConfig
    model: torch.nn.Module
    tokenizer: Any
    context_length: int
    pool_sizing: PoolSizing
    kv_pool: KVPool
    state_pool: StatePool
    stats: EngineStats  # the scheduler and the cache count into it
    cache: RequestCache
    backend: KernelBackend
    structured: StructuredOutput
    runner: ModelRunner
    eos_ids: list[int]


def load(cfg: EngineConfig) -> tuple[torch.nn.Module, Any]:
    """The model and tokenizer of ``cfg.model_path`` on ``cfg.device``."""
    from mambaradix.models.loader import DTYPES, load_model, load_tokenizer, resolve_model_path

    path = resolve_model_path(cfg.model_path)
    backend = choose_backend(cfg.kernel_backend, cfg.device)  # (refused here before the weights)
    t0 = time.perf_counter()
    model = load_model(
        path,
        dtype=cfg.dtype,
        device=cfg.device,
        ssm_dtype=DTYPES[cfg.mamba_ssm_dtype],
        mtp=cfg.speculative_algorithm in DRAFT_HEAD_ALGORITHMS,
        fast_bf16=backend.fast_bf16_on_cpu(),  # --dtype auto: bf16 where its kernels run it fast
        quantization=cfg.quantization,
    )
    logger.info("loaded the weights in %.2f s", time.perf_counter() - t0)
    return model, load_tokenizer(path)


def create_kernel_backend(cfg: EngineConfig) -> KernelBackend:
    """The engine's kernel backend for ``cfg.kernel_backend`` on ``cfg.device``
    (``kernels.backend.choose_backend``)."""
    cls = choose_backend(cfg.kernel_backend, cfg.device)
    backend = cls(cfg.device)
    native_ops = backend.native_ops()
    if native_ops:
        logger.info(
            "kernel backend %s: native %s; the torch reference for the rest (native ops that "
            "fall back for this model's dtypes or shapes are named when they first do, in the "
            "warm-up)",
            cls.name,
            ", ".join(native_ops),
        )
    else:
        logger.info("kernel backend %s", cls.name)
    return backend


def cuda_graph_sizes(cfg: EngineConfig) -> list[int]:
    """The decode batch sizes captured as CUDA graphs ([] off a CUDA device or disabled)."""
    if torch.device(cfg.device).type != "cuda" or cfg.disable_cuda_graph:
        return []
    return sorted(set(cfg.cuda_graph_bs)) or default_batch_sizes(cfg.cuda_graph_max_bs)


def wire(cfg: EngineConfig, model: torch.nn.Module, tokenizer: Any) -> EngineParts:
    """Every part but the scheduler, the runner warmed up."""
    model_ctx = int(getattr(model, "max_position_embeddings", 0) or 1 << 20)
    sizing = size_pools(
        cfg, model.kv_spec.bytes_per_token(), model.state_spec, model_weight_bytes(model)
    )
    graph_sizes = cuda_graph_sizes(cfg)
    scratch = 1 if graph_sizes else 0  # the padding rows' slots of captured steps
    kv_pool = KVPool(model.kv_spec, sizing.kv_tokens, cfg.page_size, cfg.device, scratch)
    state_pool = StatePool(model.state_spec, sizing.state_slots, cfg.device, scratch)
    context_length = min(cfg.context_length or model_ctx, sizing.kv_tokens)
    stats = EngineStats()
    cache = RequestCache(
        kv_pool,
        state_pool,
        ReqSlots(sizing.max_running, context_length + cfg.page_size),
        enabled=not cfg.disable_radix_cache,
        strategy=sizing.strategy,
        stats=stats,
        storage=make_storage_tier(cfg, model, kv_pool, state_pool),
        state_policy=cfg.state_eviction_policy,
    )
    backend = create_kernel_backend(cfg)
    eos_ids = list(getattr(model, "eos_token_ids", []) or [])
    # grammars of structured-output requests: compiled off the engine thread, masked per batch
    structured = StructuredOutput(tokenizer, model.vocab_size, eos_ids)
    runner = ModelRunner(
        model, kv_pool, state_pool, cfg.device, backend, structured,
        decode_graph_max_bs=0
        if cfg.disable_decode_graph or cfg.disable_cuda_graph
        else cfg.decode_graph_max_bs,
        cuda_graph_bs=graph_sizes,
        draft_head=cfg.speculative_algorithm in DRAFT_HEAD_ALGORITHMS,
        token_map=cfg.speculative_token_map,
    )  # fmt: skip
    if cfg.device == "cpu":  # before the warm-up, whose heap growth is then kept
        keep_freed_memory()
    if not cfg.skip_warmup:
        per_request = cfg.chunked_prefill_size
        if per_request < 1:
            per_request = cfg.max_prefill_tokens
        runner.warmup(cfg.max_prefill_tokens, min(per_request, context_length))
    return EngineParts(
        config=cfg, model=model, tokenizer=tokenizer, context_length=context_length,
        pool_sizing=sizing, kv_pool=kv_pool, state_pool=state_pool, stats=stats, cache=cache,
        backend=backend, structured=structured, runner=runner, eos_ids=eos_ids,
    )  # fmt: skip


def make_scheduler(
    parts: EngineParts,
    on_tokens: Callable[[Req, list[int], list[float]], bool],
    on_finish: Callable[[Req], None],
) -> Scheduler:
    return Scheduler(
        parts.config,
        parts.cache,
        parts.runner,
        eos_token_ids=parts.eos_ids,
        context_length=parts.context_length,
        max_running=parts.pool_sizing.max_running,
        on_tokens=on_tokens,
        on_finish=on_finish,
        capabilities=parts.backend.capabilities,  # where the backend can snapshot
    )
