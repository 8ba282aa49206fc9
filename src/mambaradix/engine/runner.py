"""Model runner: turns a scheduled batch into tensors, runs the deferred state operations,
the forward and sampling. Batches execute strictly in submission order (one worker thread
under overlap), which is what lets the scheduler treat every scheduled batch as done."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardBatch, ForwardReq, SamplingParams, StateOps
from mambaradix.engine.batch import FUTURE_STRIDE, PendingTokens, RunBatch, RunResult
from mambaradix.engine.cuda_graphs import CudaGraphs
from mambaradix.engine.mtp_draft import DraftHead
from mambaradix.engine.sampler import (
    deferrable,
    greedy_on_device,
    on_generator_device,
    sample,
    sampling_probs,
    top_logprobs,
)
from mambaradix.engine.speculative import accept_greedy, accept_sampled
from mambaradix.engine.step_graph import DecodeGraphs
from mambaradix.engine.structured import BatchMasks, StructuredOutput
from mambaradix.kernels.backend import KernelBackend, reference_backend
from mambaradix.kernels.sampling import argmax_logsumexp, logprobs_of
from mambaradix.layout import ForwardContext, ForwardLayout, to_device

logger = logging.getLogger(__name__)

WARMUP_BUDGET_S = 3.0  # most the warm-up's prefill forwards may take, judged from the first
WARMUP_MIN_TOKENS = 256  # the first prefill forward's tokens, whatever the budget
WARMUP_SINGLE_KEYS = 128  # keys of the warm-up's single-request decode steps

_KEEP_BATCHES = 4


class ModelRunner:
    """Contract: ``run(batch)`` resolves placeholder tokens from earlier batches, applies
    ``batch.forward.state_ops`` (copies, then clears) before any layer reads a state, builds the
    forward's layout once (``ForwardLayout.build``) and lets the backend prepare it, runs the
    model (or replays a recorded decode step: ``engine.step_graph``) and samples the rows in
    ``sample_rows``. With ``defer_greedy`` (on a GPU) an all-greedy batch's tokens stay on the
    device: its result's ``wait`` reads them, and later forwards read them there. The model is
    bound to ``backend`` here."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        state_pool: StatePool,
        device: str = "cpu",
        backend: KernelBackend | None = None,
        structured: StructuredOutput | None = None,
        decode_graph_max_bs: int = 0,
        cuda_graph_bs: list[int] | None = None,
        draft_head: bool = False,
        token_map: str = "",
    ) -> None:
        self.model = model
        self.structured = structured  # grammar masks of structured-output rows
        self.backend = backend or reference_backend()
        if hasattr(model, "use_backend"):
            model.use_backend(self.backend)
        self._with_kv = bool(getattr(kv_pool, "k", None))
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.device = device
        # each recent batch's sampled tokens: numbers, or a tensor on the device where the
        # batch's tokens were left there (PendingTokens) for the next forward to read in place
        self._sampled: dict[int, list[int] | torch.Tensor] = {}
        # all-greedy batches leave their tokens on a GPU (PendingTokens); never with an MTP
        # head, whose drafts read the tokens before the next forward
        self.defer_greedy = _is_gpu(device) and not draft_head
        self._carry: dict = {}  # ForwardLayout.carry: kept from one forward to the next
        self._executor: ThreadPoolExecutor | None = None
        self._num_threads = torch.get_num_threads()
        # decode steps captured once and replayed: CUDA graphs of these batch sizes where
        # given (engine.cuda_graphs), else on CPU steps of up to decode_graph_max_bs requests
        # recorded (engine.step_graph; 0: never)
        self.graphs: DecodeGraphs | CudaGraphs | None = None
        if cuda_graph_bs:
            self.graphs = CudaGraphs(
                model, self.backend, kv_pool, state_pool, cuda_graph_bs, device
            )
        elif decode_graph_max_bs > 0 and getattr(model, "replayable_decode", False):
            self.graphs = DecodeGraphs(
                model, self.backend, kv_pool, state_pool, decode_graph_max_bs
            )
        # speculative decoding's drafts from the model's MTP head, chained before each verify
        self.draft_head = (
            DraftHead(
                model,
                kv_pool,
                state_pool,
                self.backend,
                device,
                token_map,
                graph_max_bs=decode_graph_max_bs if isinstance(self.graphs, DecodeGraphs) else 0,
            )  # fmt: skip
            if draft_head
            else None
        )

    def _resolve(self, reqs: list[ForwardReq]) -> list[tuple[int, torch.Tensor, int]]:
        """Placeholder tokens (``batch.future_id``) replaced by what their batches sampled, in
        ``input_ids``, where the runner holds those as numbers. Where a batch left them on the
        device, the placeholder stays and ``(row of the packed forward, that batch's tokens,
        index)`` is returned for ``_write_device_ids``: no wait for the batch before."""
        on_device = []
        row = 0
        for r in reqs:
            if any(t < 0 for t in r.input_ids):
                ids = list(r.input_ids)
                for j, t in enumerate(ids):
                    if t >= 0:
                        continue
                    code = -t - 1
                    src, k = self._sampled[code // FUTURE_STRIDE], code % FUTURE_STRIDE
                    if isinstance(src, torch.Tensor):
                        on_device.append((row + j, src, k))
                    else:
                        ids[j] = src[k]
                r.input_ids = ids
            row += r.extend_len
        return on_device

    @staticmethod
    def _write_device_ids(layout: ForwardLayout, on_device: list) -> None:
        """The device-held tokens ``_resolve`` left into the layout's ``input_ids``, copied on
        the device (one gather per batch they come from)."""
        by_batch: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for row, src, k in on_device:
            entry = by_batch.setdefault(id(src), (src, [], []))
            entry[1].append(row)
            entry[2].append(k)
        ids = layout.input_ids
        for src, rows, ks in by_batch.values():
            take = to_device(torch.tensor(ks, dtype=torch.long), src.device)
            dest = to_device(torch.tensor(rows, dtype=torch.long), ids.device)
            ids.index_copy_(0, dest, src.index_select(0, take).to(ids.device))

    @torch.inference_mode()
    def run(self, batch: RunBatch) -> RunResult:
        t0 = time.perf_counter()
        start = _gpu_event(self.device)
        recorded = self._recordings()
        fb = batch.forward
        on_device = self._resolve(fb.reqs)
        self.state_pool.apply(fb.state_ops)
        if self.draft_head is not None:
            self.draft_head.fill(batch)
        result = RunResult(batch.batch_id, [], [])
        masks = self.structured.start(batch) if self.structured and any(batch.grammars) else None
        if fb.reqs:
            layout = ForwardLayout.build(
                fb.reqs, self.device, fb.decode_table, with_kv=self._with_kv, carry=self._carry
            )
            if on_device:
                self._write_device_ids(layout, on_device)
            self.backend.prepare(layout)
            ctx = ForwardContext(layout, self.kv_pool, self.state_pool)
            logits = self.graphs.forward(ctx) if self.graphs is not None else None
            if logits is None:
                logits = self.model.forward(ctx)
            sample_rows = batch.sample_rows
            first_row: list[int] = []
            if batch.prompt_rows or batch.drafts:  # some return logits for all their tokens
                pos = 0
                for r in fb.reqs:
                    first_row.append(pos)
                    pos += r.extend_len if r.all_logits else 1
                sample_rows = [
                    first_row[j] + (fb.reqs[j].extend_len - 1 if fb.reqs[j].all_logits else 0)
                    for j in sample_rows
                ]
            if sample_rows:
                index = to_device(torch.tensor(sample_rows, dtype=torch.long), logits.device)
            if sample_rows and self._defers(batch, masks):
                # every row greedy and nothing read on the host: the tokens stay on the device
                # (the next forward reads them there) and come back by one queued copy
                pair = greedy_on_device(logits.index_select(0, index))
                result.pending = PendingTokens(pair, start)
                result.top = [None] * len(sample_rows)
                sampled: list[int] | torch.Tensor = pair[0].long()
            elif sample_rows:
                drawn = _seeded_states(batch)  # verify rows draw again from these states
                result.tokens, result.logprobs, result.top, result.errors = self._sample(
                    logits, index, batch, masks
                )
                if masks is not None:
                    errors = result.errors or {}
                    result.grammar_ended = masks.accept(result.tokens, errors)
                    result.errors = errors or None
                for i, draft in batch.drafts.items():
                    if result.errors and i in result.errors:
                        continue
                    j = batch.sample_rows[i]
                    rows = logits[first_row[j] : first_row[j] + len(draft) + 1].float()
                    if i in drawn:
                        batch.generators[i].set_state(drawn[i])
                    self._verify(result, i, draft, rows, batch)
            for j, offset, targets, k in batch.prompt_rows:
                start = first_row[j] + offset
                rows = logits[start : start + len(targets)].float()
                _, norm = argmax_logsumexp(rows)  # as the sampler's logprobs (no [n, V] copy)
                targets_t = torch.tensor(targets, dtype=torch.long, device=rows.device)
                picked = rows.gather(1, targets_t[:, None])
                got = logprobs_of(picked, norm)[:, 0]
                result.prompt.append((got.tolist(), top_logprobs(rows, [k] * len(targets), norm)))
        self._sampled[batch.batch_id] = result.tokens if result.pending is None else sampled
        self._sampled.pop(batch.batch_id - _KEEP_BATCHES, None)
        result.extend_tokens = sum(r.extend_len for r in fb.reqs)
        result.seconds = time.perf_counter() - t0
        result.recorded = self._recordings() != recorded
        return result

    def _defers(self, batch: RunBatch, masks: BatchMasks | None) -> bool:
        """Whether this batch's tokens may stay on the device: every row greedy, and nothing
        reads them on the runner's thread (grammars, logits processing, drafts, prompt
        logprobs, top logprobs)."""
        return (
            self.defer_greedy
            and masks is None
            and not batch.drafts
            and not batch.prompt_rows
            and not any(s is not None for s in batch.logit_states)
            and deferrable(batch.params)
        )

    def _recordings(self) -> int:
        """Step graphs recorded so far (the model's and the draft head's)."""
        n = self.graphs.stats["recorded"] if self.graphs is not None else 0
        head = self.draft_head.graphs if self.draft_head is not None else None
        return n + (head.stats["recorded"] if head is not None else 0)

    def _verify(
        self, result: RunResult, i: int, draft: list[int], rows: torch.Tensor, batch: RunBatch
    ) -> None:
        """Sample row ``i`` verified ``draft``: ``rows`` [k + 1, V] are the target's logits
        after each of its input tokens; the tokens acceptance emits (``engine.speculative``)
        and their logprobs under the model's distribution replace the row's sampled token
        (the normal path's draw from the last row; a seeded generator was set back to its state
        before it, so the request draws each emitted token as decoding would)."""
        p = batch.params[i]
        greedy, norm = argmax_logsumexp(rows)
        if p.temperature == 0.0 or p.top_k == 1:
            emitted = accept_greedy(draft, greedy.tolist())
        else:
            gen = batch.generators[i]
            src = on_generator_device(rows, gen)  # where decoding computes a row's distribution
            probs = [sampling_probs(src[r], p) for r in range(src.shape[0])]
            emitted = accept_sampled(draft, torch.stack(probs), gen)
        n = len(emitted)
        picked = torch.tensor(emitted, dtype=torch.long, device=rows.device)
        chosen = rows[:n].gather(1, picked[:, None])
        lps = logprobs_of(chosen, (norm[0][:n], norm[1][:n]))[:, 0].tolist()
        result.accepted[i] = (emitted, lps)
        result.tokens[i], result.logprobs[i] = emitted[-1], lps[-1]

    def _sample(
        self,
        logits: torch.Tensor,
        index: torch.Tensor,
        batch: RunBatch,
        masks: BatchMasks | None = None,
    ) -> tuple[list[int], list[float], list, dict[int, BaseException] | None]:
        """Sample the whole batch at once (grammar rows masked by ``masks``); if that raises,
        sample row by row so that only the rows that raise fail (their requests end with an
        error; the others get exactly the tokens the batched call gives: the random
        generators are rewound first)."""
        params, gens, states = batch.params, batch.generators, batch.logit_states
        rewind = _rng_states(params, gens)
        rows = logits[index]  # a copy: masks are applied to it in place
        try:
            constrain = masks.apply if masks is not None else None
            tokens, logprobs, top = sample(rows, params, gens, states, constrain)
            return tokens, logprobs, top, None
        except Exception:
            logger.debug("batch sampling raised; sampling row by row", exc_info=True)
        _restore_rng(rewind, gens)
        rows = logits[index]  # unmasked again
        tokens, logprobs, top, errors = [], [], [], {}
        for i in range(rows.shape[0]):
            state = [states[i]] if states else None
            try:
                one = masks.apply_row(i) if masks is not None else None
                t, lp, tp = sample(rows[i : i + 1], [params[i]], [gens[i]], state, one)
                tokens.append(t[0])
                logprobs.append(lp[0])
                top.append(tp[0])
            except Exception as exc:
                errors[i] = exc
                tokens.append(int(rows[i].argmax()))  # a valid id for any batch that reads it
                logprobs.append(0.0)
                top.append(None)
        return tokens, logprobs, top, errors

    def warmup(self, num_tokens: int, per_request: int, budget_s: float = WARMUP_BUDGET_S) -> int:
        """Pay the first forwards' one-time costs before any request: a prefill forward of
        ``WARMUP_MIN_TOKENS`` tokens (requests of ``per_request``, the last cut), then, if its
        rate says more fits in what is left of ``budget_s``, one shaped like the largest prefill
        batch (``num_tokens`` new tokens) cut to fit, then a decode step of all the requests of
        the larger one and one of a single request (two with step graphs on: the second records
        batch 1's, ``engine.step_graph``), on scratch KV and state slots freed afterwards.
        Returns the prefill tokens of the larger forward (fewer than ``num_tokens`` if the pools
        are small or the model is slow).

        On CPU the allocator's heap grows to a forward's working size here (~40k page faults
        on the benchmark model), the prefill matmul path is chosen (kernels.bf16_matmul needs
        128 rows), and the decode path's kernels, plans and primitives are built. The budget
        keeps a real-size model on a slow CPU (no bf16 matmuls in hardware) from spending
        minutes on it: the page faults a cut batch leaves to the first full one cost far less
        than the forward itself. Call it before
        scheduling starts: it takes slots from the pools directly."""
        per_request = max(1, per_request)
        num_tokens = min(num_tokens, self.kv_pool.available())
        num_tokens -= num_tokens % self.kv_pool.page_size
        vocab = int(getattr(self.model, "vocab_size", 0) or 1)
        reqs: list[ForwardReq] = []
        taken: list[tuple[torch.Tensor, list[int]]] = []

        def first(tokens: int) -> list[ForwardReq]:  # the leading requests, the last one cut
            out: list[ForwardReq] = []
            for r in reqs:
                room = tokens - sum(x.extend_len for x in out)
                if room <= 0:
                    break
                if r.extend_len > room:
                    r = ForwardReq(0, r.input_ids[:room], r.kv_slots[:room], r.state_slot)
                out.append(r)
            return out

        try:
            done = 0
            while done < num_tokens:
                n = min(per_request, num_tokens - done)
                n_kv = -(-n // self.kv_pool.page_size) * self.kv_pool.page_size
                kv, state = self.kv_pool.alloc(n_kv), self.state_pool.alloc(1)
                if kv is None or state is None:
                    if kv is not None:
                        self.kv_pool.free(kv)
                    if state is not None:
                        self.state_pool.free(state)
                    break
                taken.append((kv, state))
                ids = [(done + i) * 7919 % vocab for i in range(n)]  # spread over the vocab
                reqs.append(ForwardReq(0, ids, kv[:n], state[0]))
                done += n
            if not reqs:
                return 0
            t0 = time.perf_counter()
            small = first(WARMUP_MIN_TOKENS)
            self._forward(small, StateOps(clear=[r.state_slot for r in small]))
            t1 = time.perf_counter()
            n_small = sum(r.extend_len for r in small)
            # what is left of the budget, at the rate the first forward (first-call costs
            # included, so an underestimate) ran
            allowed = int((budget_s - (t1 - t0)) * n_small / max(t1 - t0, 1e-9))
            large = first(allowed) if min(allowed, done) > n_small else []
            if large:
                self._forward(large, StateOps(clear=[r.state_slot for r in large]))
            n_large = sum(r.extend_len for r in large)
            t2 = time.perf_counter()
            # decode steps: each request's last token again, over the keys before it
            prefilled = large or small
            # the single request cut to a short one, the shape (KV table capacity) of a first
            # request's decode steps
            one = prefilled[0]
            n = min(one.seq_len, WARMUP_SINGLE_KEYS)
            one = ForwardReq(0, one.input_ids[:n], one.kv_slots[:n], one.state_slot)
            singles = [[one]] * (2 if self.graphs is not None else 1)
            for rows in (prefilled, *singles):
                decodes = [
                    ForwardReq(r.seq_len - 1, r.input_ids[-1:], r.kv_slots, r.state_slot)
                    for r in rows
                ]
                table = torch.nn.utils.rnn.pad_sequence(
                    [r.kv_slots for r in decodes], batch_first=True
                )
                self._forward(decodes, StateOps(), decode_table=table)
            logger.info(
                "warm-up %.2f s: prefill of %d tokens %.2f s, then of %d tokens in %d requests "
                "%.2f s (of %d wanted; budget %.0f s), decode steps of %d and 1 (x%d) requests "
                "%.2f s",
                time.perf_counter() - t0, n_small, t1 - t0, n_large, len(large), t2 - t1,
                num_tokens, budget_s, len(prefilled), len(singles), time.perf_counter() - t2,
            )  # fmt: skip
            return n_large or n_small
        finally:
            for kv, state in taken:
                self.kv_pool.free(kv)
                self.state_pool.free(state)
            self._sampled.pop(-1, None)
            self._carry.clear()  # nothing planned over scratch slots may reach a real forward

    def _forward(
        self, reqs: list[ForwardReq], ops: StateOps, decode_table: torch.Tensor | None = None
    ) -> None:
        """One scratch forward on the runner's thread (warm-up)."""
        fb = ForwardBatch(reqs, ops, decode_table=decode_table)
        self.submit(RunBatch(-1, fb)).result()

    def submit(self, batch: RunBatch) -> Future:
        """Run on the runner's single worker thread. Every forward runs there, with overlap or
        without, so that one thread owns the OpenMP pool (see ``engine.cpu_runtime``)."""
        return self.on_thread(self.run, batch)

    def on_thread(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on the runner's worker thread, after the work already queued there
        (benchmarks read the machine's limits on the engine's own OpenMP pool this way)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="mambaradix-runner", initializer=self._init_thread
            )
        return self._executor.submit(fn, *args)

    def _init_thread(self) -> None:
        torch.set_num_threads(self._num_threads)  # the caller's setting (--num-threads)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _is_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _gpu_event(device: str | torch.device) -> torch.cuda.Event | None:
    """An event recorded now on a GPU's current stream (where the batch's work begins)."""
    if not _is_gpu(device):
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seeded_states(batch: RunBatch) -> dict[int, torch.Tensor]:
    """The states of the seeded generators of the sampled rows that verify a draft, before
    the batch's sampling draws from them."""
    out = {}
    for i in batch.drafts:
        gen = batch.generators[i]
        if gen is not None and batch.params[i].temperature != 0.0:
            out[i] = gen.get_state()
    return out


def _rng_states(
    params: list[SamplingParams], gens: list[torch.Generator | None]
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]] | None:
    """The random states the rows may consume (None when every row is greedy: nothing)."""
    if all(p.temperature == 0.0 for p in params):
        return None
    shared = torch.get_rng_state() if any(g is None for g in gens) else None
    return shared, [g.get_state() if g is not None else None for g in gens]


def _restore_rng(
    saved: tuple[torch.Tensor | None, list[torch.Tensor | None]] | None,
    gens: list[torch.Generator | None],
) -> None:
    if saved is None:
        return
    shared, states = saved
    if shared is not None:
        torch.set_rng_state(shared)
    for g, st in zip(gens, states):
        if g is not None and st is not None:
            g.set_state(st)
