"""Continuous-batching scheduler with snapshot planning (design.md sections 5 and 6).

One ``step``: build a batch (deferred state ops, decodes, continuing prefill chunks, new
admissions), hand it to the runner, and process the results of the previous batch (overlap)
or of this one. The scheduler never touches state tensors; it records copies and clears.

Because the runner executes batches strictly in order, the scheduler treats every scheduled
batch as already computed (``fed_len``); only sampled token values arrive late (``futures``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mambaradix.cache.integrity import IntegrityError
from mambaradix.cache.request_cache import NO_BUFFER, RequestCache
from mambaradix.config import EngineConfig
from mambaradix.core import FinishReason, ForwardBatch, ForwardReq, StateOps
from mambaradix.engine.planner import admission_targets, plan_segment, snapshot_alignment
from mambaradix.engine.request import Req, ReqStatus
from mambaradix.engine.runner import ModelRunner, RunBatch, RunResult, future_id
from mambaradix.engine.sharing import held_for_sharing, shared_with_queue

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Entry:
    """What to do with one request when its batch's results arrive."""

    req: Req
    end: int
    sample_row: int | None = None
    resumed: bool = False
    track: tuple[int, int] | None = None  # extra_buffer: (position, track index)
    page_track: tuple[int, int, int] | None = None  # (position, track index, track epoch)
    prompt_idx: int | None = None  # its entry in RunBatch.prompt_rows (prompt logprobs)
    prompt_first: int = 0  # the prompt position of that entry's first target token


@dataclass(slots=True)
class BatchPlan:
    run: RunBatch
    entries: list[Entry]
    copies: list[tuple[Req, int, int]] = field(default_factory=list)  # no_buffer (req, pos, slot)


@dataclass(slots=True)
class SchedulerStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0
    admission_waits: int = 0
    held_for_sharing: int = 0
    forwards: int = 0
    finished_requests: int = 0
    resumes: int = 0  # admissions that copy a tree state into their working slot
    snapshot_copies: int = 0  # no_buffer working -> snapshot copies recorded


class Scheduler:
    """Contract: ``add`` queues a validated request; ``step`` advances the engine by one batch;
    ``abort`` ends a request wherever it is. ``on_tokens(req, ids, logprobs) -> bool`` reports
    new tokens (True: a stop string matched, finish the request); ``on_finish(req)`` reports the
    end. Resources are released once no batch in flight uses them."""

    def __init__(
        self,
        cfg: EngineConfig,
        cache: RequestCache,
        runner: ModelRunner,
        *,
        eos_token_ids: list[int],
        context_length: int,
        max_running: int,
        on_tokens: Callable[[Req, list[int], list[float]], bool] = lambda r, i, lp: False,
        on_finish: Callable[[Req], None] = lambda r: None,
    ) -> None:
        self.cfg = cfg
        self.cache = cache
        self.runner = runner
        self.eos = set(eos_token_ids)
        self.context_length = context_length
        self.max_running = max_running
        self.on_tokens = on_tokens
        self.on_finish = on_finish
        self.align = snapshot_alignment(cache.page_size)
        self.overlap = not cfg.disable_overlap_schedule
        # extra_buffer snapshots inside a forward at no extra cost: the repeat point is exact
        # up to the page, and with pages > 1 decodes keep the state at the last page boundary
        # in a tracking slot, so a finish between pages still leaves a state close behind.
        tracked = cache.strategy != NO_BUFFER
        self.repeat_align = cache.page_size if tracked else self.align
        self.page_tracking = tracked and cache.page_size > 1
        chunk = cfg.chunked_prefill_size
        self.chunk = chunk if chunk > 0 else 1 << 62
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.finishing: list[Req] = []
        self.inflight: tuple[BatchPlan, object] | None = None
        self.batch_id = 0
        self.stats = SchedulerStats()
        self._need_copy: dict[Req, int] = {}
        self._wanted: dict[Req, list[int]] = {}

    # ------------------------------------------------------------------ public

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.finishing or self.inflight)

    def abort(self, req: Req) -> None:
        if req.status is ReqStatus.FINISHED:
            return
        req.aborted = True
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

    def _end_early(self, req: Req, reason: FinishReason) -> None:
        """Abort or fail: reported at once; resources released, never cached."""
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
            req.status = ReqStatus.FINISHED
            req.finish_reason = reason
            self.on_finish(req)
            return
        self._finish(req, reason)

    def step(self) -> None:
        plan = self._schedule()
        if self.overlap:
            fut = self.runner.submit(plan.run) if plan else None
            self._drain()
            if plan:
                self.inflight = (plan, fut)
        elif plan:
            self._process(plan, self.runner.submit(plan.run).result())
        self._release_finished()

    def check_integrity(self) -> None:
        """The cache's full check, with the live entries held against this scheduler's
        requests: running ones hold resources, waiting ones none, finishing ones until
        released."""
        for req in self.waiting:
            if req.rc is not None:
                raise IntegrityError(f"waiting request {req.rid} holds cache resources")
        for req in self.running:
            if req.rc is None:
                raise IntegrityError(f"running request {req.rid} holds no cache resources")
        owners = [r.rc for r in self.running + self.finishing if r.rc is not None]
        self.cache.check_integrity(owners)

    def drain(self) -> None:
        self._drain()
        self._release_finished()

    # ------------------------------------------------------------------ scheduling

    def _schedule(self) -> BatchPlan | None:
        self._make_room_for_decodes()
        self.batch_id += 1
        bid = self.batch_id
        ops = StateOps()
        plan = BatchPlan(RunBatch(bid, ForwardBatch([], ops)), [])
        for req, pos in list(self._need_copy.items()):
            del self._need_copy[req]
            slot = self.cache.alloc_snapshot_slot(req.rc)
            if slot is not None:
                ops.add_copy(req.rc.state_slot, slot)
                plan.copies.append((req, pos, slot))
                self.stats.snapshot_copies += 1
            else:  # skipped: nobody may wait for it
                req.share_targets = [t for t in req.share_targets if t > pos]
        budget = self.cfg.max_prefill_tokens
        decodes = [r for r in self.running if r.seq_len - r.fed_len == 1 and self._schedulable(r)]
        if decodes:  # one KV allocation and one slot-row gather for the whole decode step
            got = self.cache.ensure_kv_many(
                [r.rc for r in decodes], [r.fed_len + 1 for r in decodes]
            )
            decodes = [r for r, ok in zip(decodes, got) if ok]
        if decodes:
            rows = self.cache.kv_slots_many(
                [r.rc for r in decodes], max(r.fed_len + 1 for r in decodes)
            )
            for b, req in enumerate(decodes):
                self._add_entry(plan, req, req.fed_len + 1, kv_slots=rows[b, : req.fed_len + 1])
                budget -= 1
            plan.run.forward.decode_table = rows  # the decodes come first in the batch
        for req in self.running:
            if req.seq_len - req.fed_len > 1 and budget > 0:
                budget -= self._add_prefill(plan, req, budget)
        budget = self._admit(plan, budget)
        if not plan.entries and not plan.copies:
            if self.running and not self.inflight:
                self._retract_newest()  # nothing fits: make room and try next step
            return None
        for e in plan.entries:
            e.req.inflight += 1
            if e.sample_row is not None:
                e.req.futures.append(future_id(bid, e.sample_row))
        self.stats.forwards += 1
        return plan

    def _schedulable(self, req: Req) -> bool:
        """A decode whose token would be past max_new_tokens or the context is not run."""
        return req.num_outputs() < req.params.max_new_tokens and req.seq_len < self.context_length

    def _add_prefill(self, plan: BatchPlan, req: Req, budget: int) -> int:
        """Schedule the request's next prompt chunk; returns the tokens it takes (0: none)."""
        start = req.fed_len
        chunk_end = min(req.seq_len, start + self.chunk, start + budget)
        wanted = [w for w in self._wanted.get(req, ()) if w > max(start, req.rc.tree_len)]
        if not self.cache.enabled:
            wanted = []
            seg_end, snap = chunk_end, None
        else:
            seg = plan_segment(
                start, chunk_end, req.seq_len, wanted, self.align, self.cache.strategy
            )
            seg_end, snap = seg.end, seg.snapshot
        if not self.cache.ensure_kv(req.rc, seg_end):
            return 0
        self._add_entry(plan, req, seg_end, snap)
        return seg_end - start

    def _add_entry(
        self,
        plan: BatchPlan,
        req: Req,
        end: int,
        snap: int | None = None,
        kv_slots: torch.Tensor | None = None,
    ) -> None:
        start = req.fed_len
        ids = req.token_slice(start, end)  # may hold placeholders of tokens still in flight
        entry = Entry(req, end)
        if snap is None and self.cache.enabled and end - start == 1:
            snap = end if (end % self.cfg.mamba_track_interval == 0) else None
            if snap is not None and snap % self.cache.page_size:
                snap = None
        snapshots: list[tuple[int, int]] = []
        if snap is not None:
            if self.cache.strategy == NO_BUFFER:
                self._need_copy[req] = snap  # copied out of the working slot next batch
            else:
                idx = req.track_next
                req.track_next ^= 1
                snapshots.append((snap - start, req.rc.track_slots[idx]))
                entry.track = (snap, idx)
                req.page_track = None  # that slot may be donated: nothing to fall back on
                req.track_epoch += 1
        elif self.page_tracking and end - start == 1 and end % self.cache.page_size == 0:
            # overwrite the next tracking slot with the state at this page boundary; it is
            # donated only if the request finishes before its next page (see _release_finished)
            snapshots.append((1, req.rc.track_slots[req.track_next]))
            entry.page_track = (end, req.track_next, req.track_epoch)
        if end == req.seq_len:
            entry.sample_row = len(plan.run.sample_rows)
            plan.run.sample_rows.append(len(plan.run.forward.reqs))
            plan.run.params.append(req.params)
            plan.run.generators.append(req.generator)
            plan.run.logit_states.append(req.logits_state)
        all_logits = False
        if req.params.wants_prompt_logprobs and start < len(req.prompt_ids):
            all_logits = self._plan_prompt_logprobs(plan, entry, req, start, end)
        if start < len(req.prompt_ids) or end - start > 1:
            self.stats.computed_prefill_tokens += end - start
        plan.run.forward.reqs.append(
            ForwardReq(
                prefix_len=start,
                input_ids=ids,
                kv_slots=self.cache.kv_slots(req.rc, end) if kv_slots is None else kv_slots,
                state_slot=req.rc.state_slot,
                snapshots=snapshots,
                all_logits=all_logits,
            )
        )
        plan.entries.append(entry)
        req.fed_len = end

    def _plan_prompt_logprobs(
        self, plan: BatchPlan, entry: Entry, req: Req, start: int, end: int
    ) -> bool:
        """Ask the runner for the logprobs of the prompt tokens this segment predicts (row p
        predicts token p + 1) that the request still lacks; True if there are any."""
        first_wanted = req.params.prompt_logprob_start
        first = max(first_wanted + len(req.prompt_lps), start + 1)
        last = min(end, len(req.prompt_ids) - 1)
        if first > last:
            return False
        entry.prompt_idx, entry.prompt_first = len(plan.run.prompt_rows), first
        targets = req.prompt_ids[first : last + 1]
        index = len(plan.run.forward.reqs)
        top_k = req.params.prompt_top_logprobs
        plan.run.prompt_rows.append((index, first - 1 - start, targets, top_k))
        return True

    def _match_limit(self, req: Req) -> int | None:
        """Prompt logprobs need the logits of the positions before the first token still
        lacking one: the cache may resume the request at most there."""
        if not req.params.wants_prompt_logprobs:
            return None
        return req.params.prompt_logprob_start - 1 + len(req.prompt_lps)

    def _admit(self, plan: BatchPlan, budget: int) -> int:
        if not self.waiting:
            return budget
        order = self.waiting
        if self.cfg.schedule_policy == "lpm" and self.cache.enabled:
            hits = {id(r): self.cache.match(r.tokens()).prefix_len for r in self.waiting}
            order = sorted(self.waiting, key=lambda r: -hits[id(r)])
        for req in list(order):
            if len(self.running) >= self.max_running or budget <= 0:
                break
            tokens = req.tokens()
            # matched again right before admission: an earlier admission may have evicted nodes
            limit = self._match_limit(req)
            m = self.cache.match(tokens, limit)
            if req.generator is None and req.params.seed is not None:
                try:
                    req.generator = torch.Generator().manual_seed(req.params.seed)
                except Exception as exc:  # a seed out of range that slipped through
                    self.fail(req, exc)
                    continue
            if limit is None and held_for_sharing(
                req, m.prefix_len, self.running, self._wanted, self.align
            ):
                self.stats.held_for_sharing += 1
                continue
            queue_branch = (
                shared_with_queue(req, self.waiting, m.prefix_len, self.align)
                if self.cache.enabled
                else 0
            )
            wanted = admission_targets(
                seq_len=len(tokens),
                prefix_len=m.prefix_len,
                kv_len=m.kv_len,
                queue_branch=queue_branch,
                align=self.align,
                repeat_align=self.repeat_align,
            )
            first_end = min(len(tokens), m.prefix_len + min(self.chunk, budget))
            if self.cache.enabled:
                seg = plan_segment(
                    m.prefix_len, first_end, len(tokens), wanted, self.align, self.cache.strategy
                )
                first_end = seg.end
            got = self.cache.admit(m, first_end)
            if got is None:
                self.stats.admission_waits += 1
                break
            req.rc, ops = got
            self.stats.resumes += m.prefix_len > 0
            plan.run.forward.state_ops.extend(ops)
            self.waiting.remove(req)
            self.running.append(req)
            req.status = ReqStatus.RUNNING
            req.fed_len = m.prefix_len
            req.share_targets = [queue_branch] if queue_branch > m.prefix_len else []
            self._wanted[req] = wanted
            if req.cached_tokens < 0:
                req.cached_tokens = m.prefix_len
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.stats.cached_tokens += m.prefix_len
            if req.queue_time is None:
                req.queue_time = time.monotonic() - req.arrival
            taken = self._add_prefill(plan, req, budget)
            plan.entries[-1].resumed = m.prefix_len > 0
            budget -= taken
        return budget

    # ------------------------------------------------------------------ memory pressure

    def _make_room_for_decodes(self) -> None:
        """Retract the newest requests until every decode can get its next KV slot."""
        while True:
            page = self.cache.page_size
            need = sum(
                page
                for r in self.running
                if r.seq_len - r.fed_len == 1 and r.rc.kv_alloc < r.fed_len + 1
            )
            tree = self.cache.tree
            avail = self.cache.kv_pool.available() + (tree.evictable_kv() if tree else 0)
            if need <= avail or not self.running:
                return
            self._drain()
            self._release_finished()
            if not self.running:
                return
            self._retract_newest()

    def _retract_newest(self) -> None:
        self._drain()
        self._release_finished()
        if not self.running:
            return
        victim = self.running.pop()
        self.cache.finish(victim.rc, victim.tokens(), victim.fed_len, victim.page_track)
        self._reset(victim)
        victim.status = ReqStatus.WAITING
        self.waiting.insert(0, victim)
        self.stats.retractions += 1
        logger.debug("retracted %s at %d tokens", victim.rid, victim.fed_len)

    def _reset(self, req: Req) -> None:
        req.rc = None
        req.fed_len = 0
        req.share_targets = []
        req.track_next = 0
        req.page_track = None
        self._need_copy.pop(req, None)
        self._wanted.pop(req, None)

    # ------------------------------------------------------------------ results

    def _drain(self) -> None:
        if self.inflight is None:
            return
        plan, fut = self.inflight
        self.inflight = None
        self._process(plan, fut.result())

    def _process(self, plan: BatchPlan, result: RunResult) -> None:
        for req, pos, slot in plan.copies:
            if req.rc is not None and slot in req.rc.pending:
                self.cache.insert_snapshot(req.rc, req.tokens(), pos, slot)
                req.share_targets = [t for t in req.share_targets if t > pos]
        for e in plan.entries:
            req = e.req
            req.inflight -= 1
            if req.rc is None or req.status is ReqStatus.FINISHED:
                continue
            if e.resumed:
                self.cache.resume_done(req.rc)
            if e.prompt_idx is not None:
                lps, top = result.prompt[e.prompt_idx]
                if e.prompt_first == req.params.prompt_logprob_start + len(req.prompt_lps):
                    req.prompt_lps.extend(lps)
                    req.prompt_top.extend(top)
            if e.track is not None:
                self.cache.donate_track(req.rc, e.track[1], req.tokens(), e.track[0])
            if e.page_track is not None and e.page_track[2] == req.track_epoch:
                req.page_track = e.page_track[:2]  # still what that slot holds
            if req.share_targets:  # no_buffer: a target at the cut waits for its copy
                last = e.end - 1 if self.cache.strategy == NO_BUFFER else e.end
                req.share_targets = [t for t in req.share_targets if t > last]
            if e.sample_row is None:
                continue
            tok = result.tokens[e.sample_row]
            req.futures.pop(0)
            if result.errors and e.sample_row in result.errors:
                self.fail(req, result.errors[e.sample_row])  # its sampling raised
                continue
            req.output_ids.append(tok)
            req.output_logprobs.append(result.logprobs[e.sample_row])
            if req.params.top_logprobs:
                req.output_top.append(result.top[e.sample_row])
            self.stats.generated_tokens += 1
            try:
                reason = self._finish_reason(req, tok)
                if self.on_tokens(req, [tok], [result.logprobs[e.sample_row]]):
                    reason = FinishReason.STOP  # a stop string matched
            except Exception as exc:  # detokenization / stop strings of this request
                self.fail(req, exc)
                continue
            if reason is not None:
                self._finish(req, reason)

    def _finish_reason(self, req: Req, tok: int) -> FinishReason | None:
        p = req.params
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            req.finish_matched = tok
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_length:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._need_copy.pop(req, None)
        self._wanted.pop(req, None)
        req.share_targets = []
        self.finishing.append(req)
        self.stats.finished_requests += 1
        if reason in (FinishReason.ABORT, FinishReason.ERROR):
            self.on_finish(req)

    def _release_finished(self) -> None:
        keep = []
        for req in self.finishing:
            if req.inflight:
                keep.append(req)
                continue
            if req.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                if req.rc is not None:
                    self.cache.release(req.rc)
            else:
                # Report the end only once the request's cache entries are in the tree, so a
                # follow-up request (the next chat turn) finds them.
                if req.rc is not None:
                    self.cache.finish(req.rc, req.tokens(), req.fed_len, req.page_track)
                self.on_finish(req)
            req.rc = None
        self.finishing = keep
