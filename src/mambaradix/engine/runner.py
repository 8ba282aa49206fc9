"""Model runner: turns a scheduled batch into tensors, runs the deferred state operations,
the forward and sampling. Batches execute strictly in submission order (one worker thread
under overlap), which is what lets the scheduler treat every scheduled batch as done."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardBatch, ForwardContext, ForwardReq, SamplingParams, StateOps
from mambaradix.engine.sampler import sample

logger = logging.getLogger(__name__)

FUTURE_STRIDE = 1 << 20
_KEEP_BATCHES = 4


def future_id(batch_id: int, index: int) -> int:
    """Placeholder token for the ``index``-th token sampled by ``batch_id`` (negative)."""
    return -(batch_id * FUTURE_STRIDE + index + 1)


@dataclass(slots=True)
class RunBatch:
    batch_id: int
    forward: ForwardBatch
    sample_rows: list[int] = field(default_factory=list)  # indices into forward.reqs
    params: list[SamplingParams] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)


@dataclass(slots=True)
class RunResult:
    batch_id: int
    tokens: list[int]
    logprobs: list[float]
    errors: dict[int, BaseException] | None = None  # sample row -> why sampling it raised


class ModelRunner:
    """Contract: ``run(batch)`` resolves placeholder tokens from earlier batches, applies
    ``batch.forward.state_ops`` (copies, then clears) before any layer reads a state, runs the
    model and samples the rows in ``sample_rows``."""

    def __init__(
        self, model: torch.nn.Module, kv_pool: KVPool, state_pool: StatePool, device: str = "cpu"
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.device = device
        self._sampled: dict[int, list[int]] = {}
        self._carry: dict = {}  # ForwardContext.carry: kept from one forward to the next
        self._executor: ThreadPoolExecutor | None = None
        self._num_threads = torch.get_num_threads()

    def _resolve(self, ids: list[int]) -> list[int]:
        out = []
        for t in ids:
            if t < 0:
                code = -t - 1
                t = self._sampled[code // FUTURE_STRIDE][code % FUTURE_STRIDE]
            out.append(t)
        return out

    @torch.inference_mode()
    def run(self, batch: RunBatch) -> RunResult:
        fb = batch.forward
        for r in fb.reqs:
            if any(t < 0 for t in r.input_ids):
                r.input_ids = self._resolve(r.input_ids)
        self.state_pool.apply(fb.state_ops)
        tokens: list[int] = []
        logprobs: list[float] = []
        errors = None
        if fb.reqs:
            ctx = ForwardContext.build(
                fb.reqs, self.kv_pool, self.state_pool, self.device, fb.decode_table, self._carry
            )
            logits = self.model.forward(ctx)
            if batch.sample_rows:
                rows = logits[torch.tensor(batch.sample_rows, dtype=torch.long)]
                tokens, logprobs, errors = self._sample(rows, batch)
        self._sampled[batch.batch_id] = tokens
        self._sampled.pop(batch.batch_id - _KEEP_BATCHES, None)
        return RunResult(batch.batch_id, tokens, logprobs, errors)

    def _sample(
        self, rows: torch.Tensor, batch: RunBatch
    ) -> tuple[list[int], list[float], dict[int, BaseException] | None]:
        """Sample the whole batch at once; if that raises, sample row by row so that only the
        rows that raise fail (their requests end with an error; the others get exactly the
        tokens the batched call gives: the random generators are rewound first)."""
        params, gens = batch.params, batch.generators
        rewind = _rng_states(params, gens)
        try:
            tokens, logprobs = sample(rows, params, gens)
            return tokens, logprobs, None
        except Exception:
            logger.debug("batch sampling raised; sampling row by row", exc_info=True)
        _restore_rng(rewind, gens)
        tokens, logprobs, errors = [], [], {}
        for i in range(rows.shape[0]):
            try:
                t, lp = sample(rows[i : i + 1], [params[i]], [gens[i]])
                tokens.append(t[0])
                logprobs.append(lp[0])
            except Exception as exc:
                errors[i] = exc
                tokens.append(int(rows[i].argmax()))  # a valid id for any batch that reads it
                logprobs.append(0.0)
        return tokens, logprobs, errors

    def warmup(self, num_tokens: int, per_request: int) -> int:
        """Run one forward shaped like the largest prefill batch (``num_tokens`` new tokens in
        requests of ``per_request``) on scratch KV and state slots, then a decode step of all
        those requests and one of a single request; everything is freed afterwards. Returns
        the prefill tokens it ran (fewer if the pools are small). Its point is that the first
        requests pay nothing once: on CPU the allocator's heap grows to a forward's working
        size here (~40k page faults on the benchmark model), and the decode path's kernels,
        plans and primitives are built here too. Call it before scheduling starts: it takes
        slots from the pools directly."""
        per_request = max(1, per_request)
        num_tokens = min(num_tokens, self.kv_pool.available())
        num_tokens -= num_tokens % self.kv_pool.page_size
        vocab = int(getattr(self.model, "vocab_size", 0) or 1)
        reqs: list[ForwardReq] = []
        taken: list[tuple[torch.Tensor, list[int]]] = []
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
            if reqs:
                t0 = time.perf_counter()
                clear = StateOps(clear=[r.state_slot for r in reqs])
                self.submit(RunBatch(-1, ForwardBatch(reqs, clear))).result()
                t1 = time.perf_counter()
                # decode steps: each request's last token again, over the keys before it
                for batch in (reqs, reqs[:1]):
                    decodes = [
                        ForwardReq(r.seq_len - 1, r.input_ids[-1:], r.kv_slots, r.state_slot)
                        for r in batch
                    ]
                    table = torch.nn.utils.rnn.pad_sequence(
                        [r.kv_slots for r in decodes], batch_first=True
                    )
                    fb = ForwardBatch(decodes, StateOps(), decode_table=table)
                    self.submit(RunBatch(-1, fb)).result()
                logger.info(
                    "warm-up: prefill of %d tokens in %d requests %.2f s, decode steps of %d "
                    "and 1 requests %.2f s",
                    sum(r.extend_len for r in reqs),
                    len(reqs),
                    t1 - t0,
                    len(reqs),
                    time.perf_counter() - t1,
                )
        finally:
            for kv, state in taken:
                self.kv_pool.free(kv)
                self.state_pool.free(state)
            self._sampled.pop(-1, None)
            self._carry.clear()  # nothing planned over scratch slots may reach a real forward
        return sum(r.extend_len for r in reqs)

    def submit(self, batch: RunBatch) -> Future:
        """Run on the runner's single worker thread. Every forward runs there, with overlap or
        without, so that one thread owns the OpenMP pool (see ``engine.cpu_runtime``)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix="mambaradix-runner", initializer=self._init_thread
            )
        return self._executor.submit(self.run, batch)

    def _init_thread(self) -> None:
        torch.set_num_threads(self._num_threads)  # the caller's setting (--num-threads)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


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
