"""The offline engine: ``Engine(model_path=..., **flags)``, ``generate``, ``submit``, ``abort``.

A facade over parts with one concern each: ``wiring`` builds the model's pools, cache, backend,
runner and scheduler; the ``EngineLoop`` thread owns the scheduler and takes typed messages;
the ``OutputStage`` turns new tokens into client events. Callers get their outputs through a
``RequestHandle`` (blocking iterator, asyncio iterator, or result).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mambaradix.cache.tree_view import check_args, render_tree
from mambaradix.config import EngineConfig
from mambaradix.core import SamplingParams
from mambaradix.engine import spec_costs
from mambaradix.engine.cpu_runtime import release_thread_pool
from mambaradix.engine.detokenizer import DetokState
from mambaradix.engine.health import EngineHealth, HealthReport
from mambaradix.engine.logits_process import RequestLogits, ThinkingBudget
from mambaradix.engine.loop import Abort, AbortAll, EngineLoop
from mambaradix.engine.output_stage import OutputStage
from mambaradix.engine.outputs import EngineDeadError, RequestHandle
from mambaradix.engine.request import Req
from mambaradix.engine.wiring import load, make_scheduler, wire
from mambaradix.stats import EngineStats

logger = logging.getLogger(__name__)


class Engine:
    """Offline serving engine. ``Engine(model_path="tiny:qwen3_next", page_size=16)``."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        debug_integrity: bool = False,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        **flags: Any,
    ) -> None:
        cfg = dataclasses.replace(config or EngineConfig(), **flags)
        cfg.validate()
        cfg = cfg.with_device_defaults()
        self.config = cfg
        self.model_name = cfg.model_path
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        if model is None:
            model, tokenizer = load(cfg)
        parts = wire(cfg, model, tokenizer)
        self.model, self.tokenizer = model, tokenizer
        self.context_length = parts.context_length
        self.pool_sizing = parts.pool_sizing
        self.kv_pool, self.state_pool = parts.kv_pool, parts.state_pool
        self.cache, self.runner, self.structured = parts.cache, parts.runner, parts.structured
        self.backend = parts.backend
        self.kernel_backend = parts.backend.name
        self._stats = parts.stats
        self.outputs = OutputStage(tokenizer)
        self._health = EngineHealth(cfg.watchdog_timeout)
        self.loop = EngineLoop(
            parts.structured, self.outputs, self._health, cfg.seed,
            debug_integrity or cfg.debug_integrity,
        )  # fmt: skip
        self.scheduler = make_scheduler(parts, self.outputs.on_tokens, self.loop.finished)
        self._spec_costs = self._load_spec_costs(model)
        self._ids = itertools.count()
        # Loading ran torch on this thread; its OpenMP pool would slow the runner's
        # (engine.cpu_runtime).
        release_thread_pool()
        self.loop.start(self.scheduler)
        logger.info(
            "engine ready: %s, %s weights, %s kernels\n%s",
            type(model).__name__,
            model.kv_spec.dtype,
            self.kernel_backend,
            parts.pool_sizing.describe(),
        )

    # ------------------------------------------------------------------ public API

    def submit(
        self, input_ids: list[int], params: SamplingParams | None = None, rid: str | None = None
    ) -> RequestHandle:
        req, handle = self._make_req(input_ids, params, rid)
        self.loop.queue_requests([req])
        return handle

    def submit_many(
        self, input_ids: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestHandle]:
        """Queue several requests at once (they arrive together, in one scheduler step)."""
        made = [self._make_req(ids, p, None) for ids, p in zip(input_ids, params)]
        self.loop.queue_requests([req for req, _ in made])
        return [h for _, h in made]

    def _make_req(
        self, input_ids: list[int], params: SamplingParams | None, rid: str | None
    ) -> tuple[Req, RequestHandle]:
        params = params or SamplingParams()
        params.validate(self.model.vocab_size)
        if not input_ids:
            raise ValueError("the prompt is empty; send at least one token")
        total = len(input_ids) + params.max_new_tokens
        if len(input_ids) >= self.context_length or total > self.context_length:
            raise ValueError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.context_length}; shorten the prompt or lower "
                "max_new_tokens"
            )
        vocab = self.model.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab})")
        self._raise_if_broken()
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        req = Req(rid=rid, prompt_ids=list(input_ids), params=params)
        if params.processes_logits:
            req.logits_state = RequestLogits(
                params,
                req.prompt_ids,
                vocab,
                list(getattr(self.model, "eos_token_ids", []) or []),
                self._thinking_budget(params),
            )
        if params.grammar is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            req.grammar_future = self.structured.compile_async(
                params.grammar, params.reasoning_gate
            )
        handle = RequestHandle(rid, len(input_ids))
        req.stream = handle
        req.detok = DetokState()
        return req, handle

    def _thinking_budget(self, params: SamplingParams) -> ThinkingBudget | None:
        """The request's thinking budget, its gate's tags as this tokenizer spells them."""
        gate = params.reasoning_gate
        if params.thinking_budget < 0 or gate is None:
            return None
        if self.tokenizer is None:
            raise ValueError("a thinking budget needs the model's tokenizer")
        start, end = (
            self.tokenizer.encode(t, add_special_tokens=False) for t in (gate.start, gate.end)
        )
        if not all(0 <= t < self.model.vocab_size for t in start + end):
            raise ValueError(
                f"the reasoning tags {gate.start!r} / {gate.end!r} are not in the vocabulary"
            )
        return ThinkingBudget(params.thinking_budget, start, end, gate.thinking)

    def abort(self, rid: str) -> None:
        self.loop.put(Abort(rid))

    def has_request(self, rid: str) -> bool:
        """Whether a request with id ``rid`` is in the engine, unfinished; read from any thread
        without waiting for the loop (one submitted but not yet taken from the inbox, or whose
        grammar still compiles, is not seen yet)."""
        return rid in self.loop.requests

    def abort_all(self) -> None:
        """Abort every request the engine holds (each gets a final ``abort`` event)."""
        self.loop.put(AbortAll())

    def health(self) -> HealthReport:
        """``ok`` while the loop is alive and making progress; ``stuck`` when a forward has
        run past --watchdog-timeout; ``dead`` after a fault in the engine; ``stopped``."""
        return self._health.report()

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
    ) -> dict | list[dict]:
        single = isinstance(prompt, str) or (
            input_ids is not None and len(input_ids) > 0 and isinstance(input_ids[0], int)
        )
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        elif input_ids is not None:
            ids_list = [input_ids] if single else list(input_ids)
        else:
            raise ValueError("generate() needs a prompt or input_ids")
        if isinstance(sampling_params, list):
            params = [SamplingParams(**p) for p in sampling_params]
        else:
            params = [SamplingParams(**(sampling_params or {})) for _ in ids_list]
        if len(params) != len(ids_list):
            raise ValueError("sampling_params list must have one entry per prompt")
        handles = self.submit_many(ids_list, params)
        results = [h.result() for h in handles]
        self._raise_if_broken()
        return results[0] if single else results

    def stats(self) -> EngineStats:
        """A copy of the engine's statistics, with the gauges read now."""
        usage = self.cache.token_usage()
        return dataclasses.replace(
            self._stats,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            token_usage=usage,
            num_used_tokens=round(usage * self.kv_pool.size),
            max_total_num_tokens=self.kv_pool.size,
            mamba_usage=self.cache.mamba_usage(),
            state_copies=self.state_pool.copies,
            state_copy_bytes=self.state_pool.copied_bytes,
            **self._graph_stats(),
            **self._storage_stats(),
        )

    def _storage_stats(self) -> dict[str, int | float]:
        """The tier's counters as ``storage_<counter>`` fields, and what its backend holds."""
        tier = self.cache.storage
        if tier is None:
            return {}
        c = tier.snapshot_counters()
        usage = tier.backend.usage()
        out = {f"storage_{name}": getattr(c, name) for name in c.__slots__}
        return dict(out, storage_objects=usage.objects, storage_bytes=usage.bytes)

    def _graph_stats(self) -> dict[str, int]:
        graphs = self.runner.graphs
        if graphs is None:
            return {}
        counts = dict(graphs.stats)  # (a copy: the runner's thread updates it)
        return dict(
            decode_graph_replays=counts.get("replayed", 0),
            decode_graph_recordings=counts.get("recorded", 0),
            decode_graph_bytes=graphs.nbytes,
        )

    def is_idle(self) -> bool:
        return self.call(self.scheduler.is_idle)

    def check_integrity(self) -> None:
        """Raise if any slot, request or lock is unaccounted for (run on the engine thread,
        between steps)."""
        self.call(self.scheduler.check_integrity)

    def cache_tree(self, fmt: str = "mermaid", max_nodes: int = 200) -> str:
        """The radix tree as Mermaid or DOT text (``cache.tree_view.render_tree``), read on the
        engine thread between steps. Raises ``ValueError`` with the cache disabled."""
        tree = self.cache.tree
        if tree is None:
            raise ValueError("the radix cache is disabled (--disable-radix-cache): no tree to draw")
        check_args(fmt, max_nodes)
        return self.call(lambda: render_tree(tree, fmt, max_nodes, self.tokenizer))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between steps and return its result."""
        self._raise_if_broken()
        return self.loop.call(fn)

    def shutdown(self) -> None:
        if self.loop.stopping:
            return
        if self.loop.stop(timeout=30):  # the tree is ours now: write what storage lacks
            try:
                self.cache.close_storage()
            except Exception:  # after an engine fault the tree may be what failed
                logger.exception("storage tier: the writes at shutdown failed")
            if self._spec_costs is not None:
                spec_costs.save(*self._spec_costs, self.scheduler.adaptive.costs)
        self.runner.shutdown()
        self.structured.close()
        self._health.stopped = True
        self.loop.fail_inbox()  # anything queued after the loop ended

    def _load_spec_costs(self, model: torch.nn.Module) -> tuple[Path, dict] | None:
        """Where ``--speculative-adaptive`` keeps its step costs, loaded from there (None:
        no adaptive speculation, or ``--speculative-adaptive-costs none``)."""
        if self.scheduler.adaptive is None:
            return None
        key = spec_costs.cost_key(self.config, model, self.kernel_backend)
        path = spec_costs.cost_path(self.config.speculative_adaptive_costs, key)
        if path is None:
            return None
        n = spec_costs.load(path, key, self.scheduler.adaptive.costs)
        logger.info("speculative step costs: %d shapes from %s", n, path)
        return path, key

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _raise_if_broken(self) -> None:
        error = self._health.error
        if error is not None:
            raise EngineDeadError(self._health.report().detail) from error
        if self.loop.stopping:
            raise EngineDeadError("engine is shut down")
