"""Structured output in the engine: each request's grammar from submission to its last token.

Who does what::

    submit (caller thread)      StructuredOutput.compile_async(spec, gate): compiled on the
                                compiler's thread (a reasoning gate's vocabulary tables
                                too); the request reaches the scheduler only
                                once its grammar is compiled (``when_compiled``), so the
                                engine loop never waits for a compile
    engine thread, on arrival   ``attach``: a fresh ``GrammarMatcher`` on ``Req.grammar``
                                (one per request: ``n`` copies each get their own), or the
                                compile error, which fails that request alone
    runner thread, per batch    ``start(batch)`` before the forward: the masks of the grammar
                                rows are filled on the mask thread while the model runs;
                                ``BatchMasks.apply`` after the forward (raw logprobs are
                                taken first); ``BatchMasks.accept`` advances each matcher by
                                its sampled token and reports the rows whose grammar ended

Why the masks may be filled before the batch's tokens are known: the runner executes batches
strictly in order on one thread, so when batch N+1 starts, batch N's tokens have already been
sampled and accepted by their matchers, overlap or not. A matcher is touched only on the
runner thread after ``attach``. A retracted request keeps its matcher (its accepted tokens do
not change); a request whose grammar ended while a later batch already held its row (overlap)
gets no mask there and its token is dropped by the scheduler.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from mambaradix.core import GrammarSpec, ReasoningGate
from mambaradix.engine.batch import RunBatch
from mambaradix.engine.grammar import GrammarCompiler, GrammarMatcher, apply_bitmask_rows

logger = logging.getLogger(__name__)


class StructuredOutput:
    """The engine's grammar service for one tokenizer. The compiler (its vocabulary pass
    costs about a second at 150k tokens) is built on the first grammar request."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_threads: int = 2
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size] or None
        self.max_threads = max_threads
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._mask_pool: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None
        # fill the masks on a thread while the forward runs (False: on the runner thread
        # before the forward; bench/bench_structured.py compares the two)
        self.fill_during_forward = True

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer")
                self._compiler = GrammarCompiler(
                    self.tokenizer,
                    self.vocab_size,
                    stop_token_ids=self.stop_token_ids,
                    max_threads=self.max_threads,
                )
            return self._compiler

    # ------------------------------------------------------------------ before scheduling
    def compile_async(self, spec: GrammarSpec, gate: ReasoningGate | None = None) -> Future:
        """The compiled grammar of ``spec``, as a future (a cache hit is already done). With a
        reasoning ``gate`` the future ends once the gate's vocabulary tables are built too (on
        the compiler's thread: about a second at 250k tokens, once per engine)."""
        try:
            fut = self.compiler.compile_async(spec)
            if gate is None:
                return fut
            tables = self.compiler.gate_vocab_async(gate)
        except Exception as exc:  # no tokenizer, a bad vocabulary: this request fails
            fut = Future()
            fut.set_exception(exc)
            return fut
        both: Future = Future()

        def finish(_: Future) -> None:
            try:
                tables.result()
                both.set_result(fut.result())
            except Exception as exc:
                both.set_exception(exc)

        tables.add_done_callback(lambda _: fut.add_done_callback(finish))
        return both

    @staticmethod
    def when_compiled(reqs: list[Any], put: Callable[[list[Any]], None]) -> None:
        """Call ``put(reqs)`` once every request's grammar compile has ended (at once when
        none has a grammar), keeping requests that arrive together together."""
        futs = [r.grammar_future for r in reqs if r.grammar_future is not None]
        if not futs:
            put(reqs)
            return
        left = [len(futs)]
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                put(reqs)

        for fut in futs:
            fut.add_done_callback(one_done)

    def attach(self, req: Any) -> str | None:
        """On the engine thread, as the request arrives: its matcher, or why it cannot have
        one (its grammar did not compile)."""
        fut = req.grammar_future
        if fut is None:
            return None
        req.grammar_future = None
        gate = req.params.reasoning_gate
        try:
            compiled = fut.result()
            tables = None if gate is None else self.compiler.gate_vocab(gate)  # built by now
            req.grammar = GrammarMatcher(
                compiled, self.vocab_size, tables, gate is not None and gate.thinking
            )
        except Exception as exc:
            return f"grammar: {exc}"
        return None

    # ------------------------------------------------------------------ per batch
    def start(self, batch: RunBatch) -> BatchMasks | None:
        """Begin filling the masks of ``batch``'s grammar rows (None: it has none)."""
        rows = [
            (i, m) for i, m in enumerate(batch.grammars) if m is not None and not m.is_terminated()
        ]
        if not rows:
            return None
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = self.compiler.allocate_bitmask(max(len(rows), 16))
        if self._mask_pool is None and self.fill_during_forward:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        pool = self._mask_pool if self.fill_during_forward else None
        return BatchMasks(self.compiler, rows, self._bitmask, pool)

    def close(self) -> None:
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=True)
        if self._compiler is not None:
            self._compiler.close()


class BatchMasks:
    """The grammar rows of one batch: masks being filled, applied once, tokens accepted. A
    row whose grammar waits for the end of its reasoning (``GrammarMatcher.constrains``) gets
    no mask, but its token is accepted (the matcher looks for the end tag)."""

    def __init__(
        self,
        compiler: GrammarCompiler,
        rows: list[tuple[int, GrammarMatcher]],
        bitmask: torch.Tensor,
        pool: ThreadPoolExecutor | None,
    ) -> None:
        self.rows = rows
        self.bitmask = bitmask
        self.vocab_size = compiler.vocab_size
        masked = [(row, m) for row, m in rows if m.constrains()]
        # the fill reads only the matchers' state, which the previous batch already advanced
        if pool is not None:
            self._filled = pool.submit(self._fill, compiler, masked)
        else:
            self._filled = Future()
            self._fill(compiler, masked)
            self._filled.set_result(None)
        self._slot = {row: k for k, (row, _) in enumerate(masked)}

    def _fill(self, compiler: GrammarCompiler, masked: list[tuple[int, GrammarMatcher]]) -> None:
        if not masked:
            return
        compiler.fill_masks([m for _, m in masked], self.bitmask, range(len(masked)))
        for k, (_, m) in enumerate(masked):
            extra = m.extra_allowed()
            if extra is not None:
                words = self.bitmask[k, : extra.shape[0]].numpy()
                np.bitwise_or(words, extra, out=words)

    def apply(self, logits: torch.Tensor) -> None:
        """Mask the sample rows ``logits`` [B, V] in place (rows without a grammar untouched)."""
        self._filled.result()
        apply_bitmask_rows(logits, self.bitmask, self.vocab_size, self._slot)

    def apply_row(self, row: int) -> Callable[[torch.Tensor], None]:
        """``apply`` for a one-row slice of the batch (the runner's row-by-row fallback)."""

        def one(logits: torch.Tensor) -> None:
            k = self._slot.get(row)
            if k is not None:
                self._filled.result()
                apply_bitmask_rows(logits, self.bitmask, self.vocab_size, {0: k})

        return one

    def accept(self, tokens: list[int], errors: dict[int, BaseException]) -> set[int]:
        """Advance each matcher by its row's token; a token its grammar refuses becomes that
        row's error. Returns the rows whose grammar has ended (a stop token accepted)."""
        ended: set[int] = set()
        for row, m in self.rows:
            if row in errors:
                continue
            if not m.accept(tokens[row]):
                errors[row] = ValueError(f"the grammar refused token {tokens[row]}")
            elif m.is_terminated():
                ended.add(row)
        return ended
