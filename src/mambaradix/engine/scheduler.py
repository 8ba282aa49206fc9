"""Continuous-batching scheduler (design.md sections 5 and 6).

One ``step``: build a batch (the strategy's deferred state ops, the running set's decodes and
continuing prefill chunks, new admissions), hand it to the runner, and process the results of
the previous batch (overlap) or of this one. The scheduler never touches state tensors; it
records copies and clears. Its parts, each in its own module:

- ``engine.admission``: waiting requests into the running set;
- ``engine.running``: decodes, continuing chunks, retraction;
- ``engine.results``: what a batch's results do to its requests;
- ``engine.forwards``: one request's forward appended to the batch;
- ``engine.strategies``: where snapshots land (``no_buffer`` / ``extra_buffer``).

Because the runner executes batches strictly in order, the scheduler treats every scheduled
batch as already computed (``fed_len``); only sampled token values arrive late (``futures``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from mambaradix.cache.integrity import IntegrityError
from mambaradix.cache.radix import TreeNode
from mambaradix.cache.request_cache import RequestCache
from mambaradix.config import EngineConfig
from mambaradix.core import EXTRA_BUFFER, FinishReason
from mambaradix.engine.admission import Admission
from mambaradix.engine.batch import Runner, RunResult, future_id
from mambaradix.engine.forwards import ForwardBuilder, ScheduledBatch
from mambaradix.engine.request import Req, ReqStatus
from mambaradix.engine.results import ResultProcessor
from mambaradix.engine.running import RunningSet
from mambaradix.engine.sharing import check_pins, pin_loaded, pin_waiters, unpin
from mambaradix.engine.speculative import DRAFT_HEAD_ALGORITHMS, Speculation
from mambaradix.engine.strategies import make_strategy
from mambaradix.kernels.capabilities import BackendCapabilities

logger = logging.getLogger(__name__)

_EARLY = (FinishReason.ABORT, FinishReason.ERROR)  # reported at once, never cached


class Scheduler:
    """Contract: ``add`` queues a validated request; ``step`` advances the engine by one batch;
    ``abort`` ends a request wherever it is. ``on_tokens(req, ids, logprobs) -> bool`` reports
    new tokens (True: a stop string matched, finish the request); ``on_finish(req)`` reports the
    end. Resources are released once no batch in flight uses them. ``capabilities``: what the
    kernel backend can snapshot inside a forward (the planner ends forwards where it cannot)."""

    def __init__(
        self,
        cfg: EngineConfig,
        cache: RequestCache,
        runner: Runner,
        *,
        eos_token_ids: list[int],
        context_length: int,
        max_running: int,
        on_tokens: Callable[[Req, list[int], list[float]], bool] = lambda r, i, lp: False,
        on_finish: Callable[[Req], None] = lambda r: None,
        capabilities: BackendCapabilities | None = None,
    ) -> None:
        if not cfg.chunked_prefill_size or not cfg.max_prefill_tokens:
            raise ValueError(
                "the scheduler takes a config with its prefill sizes decided: pass "
                "cfg.with_device_defaults() (the Engine does)"
            )
        self.cfg = cfg
        self.cache = cache
        self.runner = runner
        self.max_running = max_running
        self.on_finish = on_finish
        self.overlap = not cfg.disable_overlap_schedule
        self.stats = cache.stats  # one record: the cache counts into it too
        self.strategy = make_strategy(cache, self.stats, capabilities)
        self.builder = ForwardBuilder(
            cache,
            self.strategy,
            self.stats,
            chunk=cfg.chunked_prefill_size,
            track_interval=cfg.mamba_track_interval,
        )
        self.admission = Admission(
            cache,
            self.strategy,
            self.builder,
            self.stats,
            max_running=max_running,
            lpm=cfg.schedule_policy == "lpm",
            fail=self.fail,
        )
        speculation = None
        if cfg.speculative_algorithm:
            speculation = Speculation(
                cfg.speculative_num_steps,
                cfg.speculative_ngram_min_match_window_size,
                cfg.speculative_ngram_max_match_window_size,
                context_length=context_length,
                page_size=cache.page_size,
                track_interval=cfg.mamba_track_interval,
                page_snapshots=self.strategy.name == EXTRA_BUFFER,
                draft_head=cfg.speculative_algorithm in DRAFT_HEAD_ALGORITHMS,
                max_batch=cfg.speculative_disable_by_batch_size,
                adaptive=cfg.speculative_adaptive,
            )
            self.overlap = False  # a draft needs the tokens the step before accepted
        self.adaptive = speculation.adaptive if speculation else None
        self.running_set = RunningSet(
            cache,
            self.strategy,
            self.builder,
            self.stats,
            context_length=context_length,
            settle=self.drain,
            speculation=speculation,
        )
        self.results = ResultProcessor(
            cache,
            self.strategy,
            self.stats,
            eos_token_ids=eos_token_ids,
            context_length=context_length,
            on_tokens=on_tokens,
            finish=self._finish,
            fail=self.fail,
            adaptive=self.adaptive,
        )
        self.waiting: list[Req] = []
        self.strategy.on_shared = self._pin_waiters
        self.running: list[Req] = []
        self.finishing: list[Req] = []
        self.inflight: tuple[ScheduledBatch, Future] | None = None
        self.batch_id = 0

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.strategy.capabilities

    @capabilities.setter
    def capabilities(self, caps: BackendCapabilities) -> None:
        self.strategy.capabilities = caps

    # ------------------------------------------------------------------ public

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def is_idle(self) -> bool:
        # a load from storage still holds slots and a tree lock until collected
        return not (
            self.waiting or self.running or self.finishing or self.inflight or self.cache.loading
        )

    def abort(self, req: Req) -> None:
        if req.status is ReqStatus.FINISHED:
            return
        self._end_early(req, FinishReason.ABORT)

    def fail(self, req: Req, exc: BaseException) -> None:
        """A fault while handling this one request (sampling setup, stop strings,
        detokenization, a parameter validation missed): end it with an error, free its slots
        once no batch in flight uses them, keep serving the others."""
        if req.status is ReqStatus.FINISHED:
            return
        logger.error("request %s failed: %r", req.rid, exc, exc_info=exc)
        req.error = f"request failed: {type(exc).__name__}: {exc}"
        self._end_early(req, FinishReason.ERROR)

    def step(self) -> None:
        batch = self._schedule()
        if self.overlap:
            fut = self.runner.submit(batch.run) if batch else None
            self._drain()
            if batch:
                self.inflight = (batch, fut)
        elif batch:
            self._process(batch, self.runner.submit(batch.run).result())
        if batch is None and self.inflight is None and self.cache.loading:
            if self.cache.poll_loads(wait=0.005):  # only loads pending: wait for one, don't spin
                pin_loaded(self.cache.tree, self.waiting)
        self._release_finished()

    def check_integrity(self) -> None:
        """The cache's full check, with the live entries held against this scheduler's
        requests: running ones hold resources, waiting ones none, finishing ones until
        released."""
        for req in self.waiting:
            if req.rc is not None:
                raise IntegrityError(f"waiting request {req.rid} holds cache resources")
        for req in self.running + self.finishing:
            if req.wait_pin is not None:
                raise IntegrityError(f"request {req.rid} pins a state it no longer waits for")
        for req in self.running:
            if req.rc is None:
                raise IntegrityError(f"running request {req.rid} holds no cache resources")
        owners = [r.rc for r in self.running + self.finishing if r.rc is not None]
        self.cache.check_integrity(owners)
        if self.cache.tree is not None:
            check_pins(self.cache.tree, self.waiting)

    def _pin_waiters(self, holder: Req, position: int, node: TreeNode) -> None:
        pin_waiters(self.cache.tree, holder, position, node, self.waiting)

    def drain(self) -> None:
        """Process the batch in flight and release what finished."""
        self._drain()
        self._release_finished()

    # ------------------------------------------------------------------ one batch

    def _schedule(self) -> ScheduledBatch | None:
        self.running_set.make_room_for_decodes(self.running, self.waiting)
        self.batch_id += 1
        batch = ScheduledBatch.new(self.batch_id)
        batch.copies = self.strategy.start_batch(batch.state_ops)
        budget = self.running_set.schedule(batch, self.running, self.cfg.max_prefill_tokens)
        self.admission.admit(batch, budget, self.waiting, self.running)
        if not batch.entries and not batch.copies:
            if self.running and not self.inflight:  # nothing fits: make room, try next step
                self.running_set.retract_newest(self.running, self.waiting)
            return None
        if self.cache.pending_writes:  # loads collected: their data lands before anything reads
            batch.state_ops.writes[:0] = self.cache.take_writes()
        for e in batch.entries:
            e.req.inflight += 1
            if e.sample_row is not None:
                e.req.futures.append(future_id(batch.run.batch_id, e.sample_row))
        self.stats.forwards += 1
        return batch

    def _drain(self) -> None:
        if self.inflight is None:
            return
        batch, fut = self.inflight
        self.inflight = None
        self._process(batch, fut.result())

    def _process(self, batch: ScheduledBatch, result: RunResult) -> None:
        result.wait()  # a batch whose tokens the runner left on the device: here they arrive
        if result.extend_tokens >= 64:  # prefill-sized: what a token costs
            cost = result.seconds / result.extend_tokens
            old = self.admission.s_per_token
            self.admission.s_per_token = cost if old <= 0 else 0.8 * old + 0.2 * cost
        shape = batch.decode_rows
        if (
            self.adaptive is not None
            and shape
            and shape[1] == result.extend_tokens  # decodes and verifies alone
            and not result.recorded
        ):
            self.adaptive.observe_step(*shape, result.seconds)
        self.results.process(batch, result)

    # ------------------------------------------------------------------ the end of a request

    def _end_early(self, req: Req, reason: FinishReason) -> None:
        """Abort or fail: reported at once; resources released, never cached."""
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
            unpin(self.cache.tree, req)
            req.status = ReqStatus.FINISHED
            req.finish_reason = reason
            self.on_finish(req)
            return
        self._finish(req, reason)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self.strategy.end(req)
        self.finishing.append(req)
        self.stats.finished_requests += 1
        if reason in _EARLY:
            self.on_finish(req)

    def _release_finished(self) -> None:
        keep = []
        for req in self.finishing:
            if req.inflight:
                keep.append(req)
                continue
            if req.finish_reason in _EARLY:
                if req.rc is not None:
                    self.cache.release(req.rc)
            else:
                # Report the end only once the request's cache entries are in the tree, so a
                # follow-up request (the next chat turn) finds them.
                if req.rc is not None:
                    track = self.strategy.finish_track(req)
                    self.cache.finish(req.rc, req.tokens(), req.fed_len, track)
                self.on_finish(req)
            req.rc = None
        self.finishing = keep
