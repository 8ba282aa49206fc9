"""Offline engine API: ``Engine(model_path=..., **flags)``, ``generate``, ``submit``, ``abort``.

The scheduler runs on one background thread; callers talk to it through an inbox, and get
their outputs through a ``RequestHandle`` (blocking iterator, asyncio iterator, or result).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.request_cache import RequestCache
from mambaradix.cache.state_pool import StatePool
from mambaradix.cache.tree_view import check_args, render_tree
from mambaradix.config import EngineConfig
from mambaradix.core import SEED_LIMIT, FinishReason, SamplingParams
from mambaradix.engine.cpu_runtime import (
    keep_freed_memory,
    release_thread_pool,
    serial_torch_thread,
)
from mambaradix.engine.cuda_graphs import default_batch_sizes
from mambaradix.engine.detokenizer import DetokState, IncrementalDetokenizer, find_stop, holdback
from mambaradix.engine.health import EngineHealth, HealthReport
from mambaradix.engine.logits_process import RequestLogits
from mambaradix.engine.outputs import (
    ENGINE_DEAD,
    EngineDeadError,
    OutputBatcher,
    RequestHandle,
    RequestOutput,
)
from mambaradix.engine.pools import model_weight_bytes, plan_pools
from mambaradix.engine.request import Req
from mambaradix.engine.runner import ModelRunner
from mambaradix.engine.scheduler import Scheduler
from mambaradix.engine.storage_setup import make_storage_tier
from mambaradix.engine.structured import StructuredOutput
from mambaradix.kernels.backend import KernelBackend, choose_backend
from mambaradix.stats import EngineStats

logger = logging.getLogger(__name__)

ARRIVAL_WINDOW_S = 0.01  # waking from idle: how long a burst may take to arrive
_FAIL_LOCK = threading.Lock()  # failing queued work may run on a caller's thread and the loop's


def create_kernel_backend(cfg: EngineConfig) -> KernelBackend:
    """The engine's kernel backend for ``cfg.kernel_backend`` on ``cfg.device``
    (``kernels.backend.choose_backend``)."""
    cls = choose_backend(cfg.kernel_backend, cfg.device)
    name = cls.name
    backend = cls(cfg.device)
    native_ops = backend.native_ops()
    if native_ops:
        logger.info(
            "kernel backend %s: native %s; the torch reference for the rest (native ops that "
            "fall back for this model's dtypes or shapes are named when they first do, in the "
            "warm-up)",
            name,
            ", ".join(native_ops),
        )
    else:
        logger.info("kernel backend %s", name)
    return backend


def cuda_graph_sizes(cfg: EngineConfig) -> list[int]:
    """The decode batch sizes captured as CUDA graphs ([] off a CUDA device or disabled)."""
    if torch.device(cfg.device).type != "cuda" or cfg.disable_cuda_graph:
        return []
    return sorted(set(cfg.cuda_graph_bs)) or default_batch_sizes(cfg.cuda_graph_max_bs)


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
        self.config = cfg
        self.model_name = cfg.model_path
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        if model is None:
            from mambaradix.models.loader import (
                DTYPES,
                load_model,
                load_tokenizer,
                resolve_model_path,
            )

            path = resolve_model_path(cfg.model_path)
            t0 = time.perf_counter()
            model = load_model(
                path, dtype=cfg.dtype, device=cfg.device, ssm_dtype=DTYPES[cfg.mamba_ssm_dtype]
            )
            logger.info("loaded the weights in %.2f s", time.perf_counter() - t0)
            tokenizer = load_tokenizer(path)
        self.model = model
        self.tokenizer = tokenizer
        model_ctx = int(getattr(model, "max_position_embeddings", 0) or 1 << 20)
        self.context_length = cfg.context_length or model_ctx
        plan = plan_pools(
            cfg, model.kv_spec.bytes_per_token(), model.state_spec, model_weight_bytes(model)
        )
        self.pool_plan = plan
        kv_tokens, state_slots = plan.kv_tokens, plan.state_slots
        strategy, max_running = plan.strategy, plan.max_running
        enabled = not cfg.disable_radix_cache
        cuda_graph_bs = cuda_graph_sizes(cfg)
        scratch = 1 if cuda_graph_bs else 0  # the padding rows' slots of captured steps
        self.kv_pool = KVPool(model.kv_spec, kv_tokens, cfg.page_size, cfg.device, scratch)
        self.state_pool = StatePool(model.state_spec, state_slots, cfg.device, scratch)
        self.context_length = min(self.context_length, kv_tokens)
        req_slots = ReqSlots(max_running, self.context_length + cfg.page_size)
        self._stats = EngineStats()  # the scheduler and the cache count into it
        self.cache = RequestCache(
            self.kv_pool,
            self.state_pool,
            req_slots,
            enabled=enabled,
            strategy=strategy,
            stats=self._stats,
            storage=make_storage_tier(cfg, model, self.kv_pool, self.state_pool),
        )
        self.backend = create_kernel_backend(cfg)
        self.kernel_backend = self.backend.name
        eos_ids = list(getattr(model, "eos_token_ids", []) or [])
        # grammars of structured-output requests: compiled off this thread, masked per batch
        self.structured = StructuredOutput(tokenizer, model.vocab_size, eos_ids)
        self._compiling: set[str] = set()  # rids whose grammar is compiling (not queued yet)
        self._aborted_early: set[str] = set()  # of those, aborted before they were queued
        self.runner = ModelRunner(
            model, self.kv_pool, self.state_pool, cfg.device, self.backend, self.structured,
            decode_graph_max_bs=0 if cfg.disable_decode_graph else cfg.decode_graph_max_bs,
            cuda_graph_bs=cuda_graph_bs,
        )  # fmt: skip
        if cfg.device == "cpu":  # before the warm-up, whose heap growth is then kept
            keep_freed_memory()
        if not cfg.skip_warmup:
            per_request = cfg.chunked_prefill_size
            if per_request < 1:
                per_request = cfg.max_prefill_tokens
            per_request = min(per_request, self.context_length)
            self.runner.warmup(cfg.max_prefill_tokens, per_request)
        self.scheduler = Scheduler(
            cfg,
            self.cache,
            self.runner,
            eos_token_ids=eos_ids,
            context_length=self.context_length,
            max_running=max_running,
            on_tokens=self._on_tokens,
            on_finish=self._on_finish,
            capabilities=self.backend.capabilities,  # where the backend can snapshot
        )
        # sampling requests without a seed of their own draw one from this at submission, so
        # that --seed makes their samples reproducible
        self._seeds = random.Random(cfg.seed)
        self.debug_integrity = debug_integrity or cfg.debug_integrity
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._reqs: dict[str, Req] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._outbox = OutputBatcher()  # flushed after every turn of the engine loop
        self._health = EngineHealth(cfg.watchdog_timeout)
        self._stop = False
        self._ids = itertools.count()
        # Loading ran torch on this thread; its OpenMP pool would slow the runner's
        # (engine.cpu_runtime).
        release_thread_pool()
        self._thread = threading.Thread(target=self._loop, name="mambaradix-engine", daemon=True)
        self._thread.start()
        logger.info(
            "engine ready: %s, %s weights, %s kernels\n%s",
            type(model).__name__,
            model.kv_spec.dtype,
            self.kernel_backend,
            plan.describe(),
        )

    # ------------------------------------------------------------------ public API

    def submit(
        self, input_ids: list[int], params: SamplingParams | None = None, rid: str | None = None
    ) -> RequestHandle:
        req, handle = self._make_req(input_ids, params, rid)
        self._queue([req])
        return handle

    def submit_many(
        self, input_ids: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestHandle]:
        """Queue several requests at once (they arrive together, in one scheduler step)."""
        made = [self._make_req(ids, p, None) for ids, p in zip(input_ids, params)]
        self._queue([req for req, _ in made])
        return [h for _, h in made]

    def _queue(self, reqs: list[Req]) -> None:
        """To the engine thread, once their grammars (if any) are compiled."""
        self._compiling.update(r.rid for r in reqs if r.grammar_future is not None)
        self.structured.when_compiled(reqs, lambda ready: self._put(("add", ready)))

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
                params, req.prompt_ids, vocab, list(getattr(self.model, "eos_token_ids", []) or [])
            )
        if params.grammar is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            req.grammar_future = self.structured.compile_async(params.grammar)
        handle = RequestHandle(rid, len(input_ids))
        req.stream = handle
        req.detok = DetokState()
        return req, handle

    def abort(self, rid: str) -> None:
        self._put(("abort", rid))

    def abort_all(self) -> None:
        """Abort every request the engine holds (each gets a final ``abort`` event)."""
        self._put(("abort_all",))

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
        fut: Future = Future()
        self._put(("call", fn, fut))
        return fut.result()

    def shutdown(self) -> None:
        if self._stop:
            return
        self._stop = True
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)
        if not self._thread.is_alive():  # the tree is ours now: write what storage lacks
            try:
                self.cache.close_storage()
            except Exception:  # after an engine fault the tree may be what failed
                logger.exception("storage tier: the writes at shutdown failed")
        self.runner.shutdown()
        self.structured.close()
        self._health.stopped = True
        self._fail_inbox()  # anything queued after the loop ended

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ engine thread

    def _raise_if_broken(self) -> None:
        error = self._health.error
        if error is not None:
            raise EngineDeadError(self._health.report().detail) from error
        if self._stop:
            raise EngineDeadError("engine is shut down")

    def _put(self, item: tuple) -> None:
        """Queue for the engine thread. If the loop has ended (a fault, or shut down), what
        was queued fails at once instead of waiting for a loop that will never run it."""
        self._inbox.put(item)
        if self._health.error is not None or not self._thread.is_alive():
            self._fail_inbox()

    def _loop(self) -> None:
        serial_torch_thread()  # no OpenMP pool beside the runner's (engine.cpu_runtime)
        health = self._health
        while not self._stop:
            try:
                self._pull(block=self.scheduler.is_idle())
                if self._stop:
                    self._outbox.flush()
                    break
                if not self.scheduler.is_idle():
                    health.step_started()
                    self.scheduler.step()
                    if self.debug_integrity:
                        self.scheduler.check_integrity()
                    health.step_done()
                self._outbox.flush()
            except BaseException as exc:  # a fault of the engine itself: it is dead
                health.die(exc)
                logger.exception("engine failed; every running and later request fails")
                self._fail_all()
                return

    def _pull(self, block: bool) -> None:
        """Take everything in the inbox. Waking from idle, wait a moment for the rest of a
        burst, so that requests sent together are planned together (in-batch sharing)."""
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.1 if block else None)
            except queue.Empty:
                return
            if block:
                time.sleep(ARRIVAL_WINDOW_S)
            block = False
            kind = item[0]
            if kind == "call":
                _, fn, fut = item
                try:
                    if not self.scheduler.is_idle():
                        self.scheduler.drain()
                except BaseException as exc:  # a forward raised: the engine is dead
                    fut.set_exception(exc)
                    raise
                try:
                    result = fn()
                    self._outbox.flush()
                    fut.set_result(result)
                except BaseException as exc:
                    fut.set_exception(exc)
            elif kind == "add":
                for req in item[1]:
                    if not self._grammar_ready(req):
                        continue
                    self._reqs[req.rid] = req
                    self._seed_unseeded(req)
                    self.scheduler.add(req)
            elif kind == "abort":
                req = self._reqs.get(item[1])
                if req is not None:
                    self.scheduler.abort(req)
                elif item[1] in self._compiling:
                    self._aborted_early.add(item[1])
            elif kind == "abort_all":
                for req in list(self._reqs.values()):
                    self.scheduler.abort(req)
            elif kind == "stop":
                return

    def _grammar_ready(self, req: Req) -> bool:
        """The request's matcher attached; False when it ended here instead (its grammar did
        not compile, or it was aborted while compiling)."""
        if req.grammar_future is None:
            return True
        self._compiling.discard(req.rid)
        error = self.structured.attach(req)
        if req.rid in self._aborted_early:
            self._aborted_early.discard(req.rid)
            req.finish_reason = FinishReason.ABORT
        elif error is not None:
            logger.info("request %s failed: %s", req.rid, error)
            req.finish_reason, req.error = FinishReason.ERROR, error
        else:
            return True
        self._emit(req, [], None, "", finished=True)
        return False

    def _seed_unseeded(self, req: Req) -> None:
        """A sampling request without a seed draws one from the engine's ``--seed`` generator
        (in arrival order); greedy and seeded requests are left alone."""
        p = req.params
        if p.seed is not None or p.temperature == 0.0 or p.top_k == 1:
            return
        seed = self._seeds.randrange(SEED_LIMIT)
        req.generator = torch.Generator().manual_seed(seed)

    def _fail_all(self) -> None:
        """The engine died: every request it holds or has queued ends with an error event."""
        detail = self._health.report().detail
        for req in list(self._reqs.values()):
            self._fail_req(req, detail)
        self._reqs.clear()
        self._fail_inbox()

    def _fail_req(self, req: Req, detail: str) -> None:
        req.finish_reason = FinishReason.ERROR
        req.error = detail if detail.startswith(ENGINE_DEAD) else f"{ENGINE_DEAD}: {detail}"
        self._emit(req, [], None, "", finished=True)

    def _fail_inbox(self) -> None:
        """Fail what waits in the inbox (the loop has ended); safe from any thread."""
        detail = self._health.report().detail if self._health.error else "engine is shut down"
        with _FAIL_LOCK:
            self._fail_queued(detail)

    def _fail_queued(self, detail: str) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item[0] == "add":
                for req in item[1]:
                    self._fail_req(req, detail)
            elif item[0] == "call":
                item[2].set_exception(EngineDeadError(detail))
        self._outbox.flush()

    def _on_tokens(self, req: Req, ids: list[int], logprobs: list[float]) -> bool:
        stop_hit = False
        st: DetokState = req.detok
        if self._detok is not None:
            self._detok.step(st, req.output_ids)
            stops = req.params.stop
            if stops:
                found = find_stop(st.text, stops, st.sent)
                if found is not None:
                    st.text = st.text[: found[0]]
                    req.finish_matched = found[1]
                    stop_hit = True
        text = self._take_text(req, final=stop_hit)
        lps = logprobs if req.params.return_logprob else None
        self._emit(req, ids, lps, text, finished=False)
        return stop_hit

    def _logprob_extras(self, req: Req, out: RequestOutput, num_new: int) -> None:
        """Top-k logprobs of the new tokens and, once, the prompt logprobs."""
        p = req.params
        if p.return_logprob and p.top_logprobs and num_new:
            out.new_top_logprobs = req.output_top[-num_new:]
        if p.wants_prompt_logprobs and not req.prompt_sent and (num_new or out.finished):
            req.prompt_sent = True
            out.prompt_logprobs = list(req.prompt_lps)
            out.prompt_top_logprobs = list(req.prompt_top) if p.prompt_top_logprobs else None

    def _take_text(self, req: Req, final: bool) -> str:
        st: DetokState = req.detok
        if self._detok is None:
            return ""
        end = len(st.text) if final else len(st.text) - holdback(st.text, req.params.stop)
        text = st.text[st.sent : end] if end > st.sent else ""
        st.sent = max(st.sent, end)
        return text

    def _on_finish(self, req: Req) -> None:
        self._reqs.pop(req.rid, None)
        text = ""
        if req.error is None:
            try:
                if self._detok is not None and not isinstance(req.finish_matched, str):
                    self._detok.flush(req.detok, req.output_ids)  # no stop string cut the text
                text = self._take_text(req, final=True)
            except Exception as exc:  # this request's detokenization: it alone fails
                logger.error("request %s failed: %r", req.rid, exc, exc_info=exc)
                req.finish_reason = FinishReason.ERROR
                req.error = f"request failed: {type(exc).__name__}: {exc}"
        self._emit(req, [], None, text, finished=True)

    def _emit(
        self, req: Req, ids: list[int], lps: list[float] | None, text: str, finished: bool
    ) -> None:
        handle: RequestHandle = req.stream
        reason = req.finish_reason.value if (finished and req.finish_reason) else None
        out = RequestOutput(
            rid=req.rid,
            new_token_ids=list(ids),
            new_text=text,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            storage_tokens=req.storage_tokens,
            new_logprobs=lps,
            finish_matched=req.finish_matched if finished else None,
            error=req.error if finished else None,
            queue_time=req.queue_time,
        )
        if req.params.return_logprob or req.params.wants_prompt_logprobs:
            self._logprob_extras(req, out, len(ids))
        self._outbox.put(handle, out)
