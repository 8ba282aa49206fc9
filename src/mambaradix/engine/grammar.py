"""Grammar-constrained decoding (structured output), engine side, on xgrammar.

Three pieces:

- ``GrammarSpec`` (``core``): the grammar a request's output must match, as plain data; the
  server makes it from its API's fields (``server.structured``). ``validate_spec`` builds it
  without a tokenizer (cheap), so a bad schema, regex or EBNF is a ``ValueError`` naming the
  caller's field before the request is queued.
- ``GrammarCompiler``: owned by the engine, one per tokenizer. Compiles specs against the
  vocabulary (off the engine thread through ``compile_async``) and keeps the compiled grammars
  in a bounded LRU keyed by spec.
- ``GrammarMatcher``: one per request. Per decode step the compiler's ``fill_masks`` writes
  the allowed tokens of a batch's matchers into a bitmask (multi-threaded) and
  ``apply_bitmask_rows`` masks their logits rows with it (tokens the grammar forbids and padded
  rows past the tokenizer's vocabulary get ``-inf``; the stop tokens are allowed only where the
  grammar may end): ``engine.structured.BatchMasks``. ``accept(token)`` advances a matcher
  after sampling, ``is_terminated()`` says the request is finished (a stop token was accepted
  once the grammar was complete).

xgrammar was picked over llguidance by measurement (``bench/bench_grammar.py``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from mambaradix.core import GRAMMAR_KINDS, GrammarSpec, ReasoningGate


def _lazy_module(name: str):
    """``name`` imported on its first attribute access (importlib's ``LazyLoader``)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"{name} is not installed (pip install {name})")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# xgrammar (and what it imports) takes ~0.4 s to import: paid by the first request that uses a
# grammar (whose compiler costs ~1 s to build anyway), not by every engine start
xgr = _lazy_module("xgrammar")

logger = logging.getLogger(__name__)

__all__ = ["GRAMMAR_KINDS", "GrammarCompiler", "GrammarMatcher", "GrammarSpec", "validate_spec"]

_COMPACT = (",", ":")
# up to this vocabulary xgrammar's CPU kernel (every bit of every row, in C++) beats the word
# skipping of apply_bitmask_rows, whose Python per row costs more than the whole row there
_SMALL_VOCAB = 16384
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


# xgrammar 0.2.9 writes a length-bounded JSON string's characters as [^"\\\r\n], which lets raw
# control characters (U+0000..U+001F, tab included) through: not JSON (RFC 8259 7), and
# json.loads refuses it. Its unbounded strings use the right class; use it for both.
_LAX_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def json_schema_grammar(
    source: str, any_whitespace: bool, separators: tuple[str, str] = _COMPACT
) -> xgr.Grammar:
    """xgrammar's grammar of a JSON schema (``separators`` unless ``any_whitespace``), with
    string characters restricted to what JSON allows unescaped."""
    if any_whitespace:
        grammar = xgr.Grammar.from_json_schema(source, any_whitespace=True)
    else:
        grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False, separators=separators)
    text = str(grammar)
    if _LAX_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR))


def _check_supported(schema: Any, field: str) -> None:
    """Refuse what xgrammar would silently drop: ``pattern`` together with a string length."""
    if isinstance(schema, dict):
        if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
            raise ValueError(
                f"{field}: 'pattern' combined with 'minLength'/'maxLength' is not supported; "
                "put the length into the pattern"
            )
        for value in schema.values():
            _check_supported(value, field)
    elif isinstance(schema, list):
        for value in schema:
            _check_supported(value, field)


def validate_spec(spec: GrammarSpec, field: str = "grammar") -> None:
    """Build the spec's grammar without a tokenizer (cheap: no vocabulary pass); a schema the
    converter does not support, a bad regex or bad EBNF raises ``ValueError`` naming ``field``."""
    try:
        if spec.kind == "json_schema":
            _check_supported(json.loads(spec.source), field)
            json_schema_grammar(spec.source, spec.any_whitespace)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.source)
    except ValueError as e:
        if str(e).startswith(field):
            raise
        raise ValueError(f"{field}: invalid {spec.kind}: {e}") from None
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError
        raise ValueError(f"{field}: invalid {spec.kind}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    """An xgrammar error's message without its ``[time] file.cc:line:`` prefix."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return _CPP_PREFIX.sub("", text.splitlines()[0])


class GrammarCompiler:
    """Compiles ``GrammarSpec`` s against one tokenizer's vocabulary; thread-safe.

    ``vocab_size``: rows of the model's logits (may exceed the tokenizer's vocabulary: the
    padded ids are never allowed). ``stop_token_ids``: the tokens that end a request (default:
    the tokenizer's EOS); the grammar allows them only where it may end. Compiled grammars are
    kept in an LRU of ``cache_size`` entries; concurrent compiles of one spec share one job."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: Sequence[int] | None = None,
        cache_size: int = 128,
        max_threads: int = 2,
    ) -> None:
        if stop_token_ids is None:
            eos = tokenizer.eos_token_id
            stop_token_ids = [] if eos is None else [eos]
        stop = sorted({int(t) for t in stop_token_ids})
        if not stop or any(not 0 <= t < vocab_size for t in stop):
            raise ValueError(f"stop_token_ids {stop} must be non-empty ids < {vocab_size}")
        self.vocab_size = vocab_size
        self.stop_token_ids = stop
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=max_threads, cache_enabled=False
        )
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = max(1, cache_size)
        self._inflight: dict[GrammarSpec, Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self.hits = 0
        self.misses = 0
        self._gate_vocabs: dict[tuple[str, str], GateVocab] = {}

    def gate_vocab_async(self, gate: ReasoningGate) -> Future[GateVocab]:
        """``gate_vocab`` on the compiler's thread (an already-done future once built)."""
        with self._lock:
            vocab = self._gate_vocabs.get((gate.start, gate.end))
        if vocab is not None:
            done: Future[GateVocab] = Future()
            done.set_result(vocab)
            return done
        return self._pool.submit(self.gate_vocab, gate)

    def gate_vocab(self, gate: ReasoningGate) -> GateVocab:
        """The vocabulary tables of ``gate``'s tags (built once per pair of tags)."""
        key = (gate.start, gate.end)
        with self._lock:
            vocab = self._gate_vocabs.get(key)
        if vocab is None:
            vocab = GateVocab(self.info.decoded_vocab, self.vocab_size, gate)
            with self._lock:
                vocab = self._gate_vocabs.setdefault(key, vocab)
        return vocab

    # ------------------------------------------------------------------ compiling
    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); ``ValueError`` if it does not compile."""
        return self.compile_async(spec).result()

    def compile_async(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar, compiled on the compiler's own thread (a cache hit
        is an already-done future). Its exception is a ``ValueError`` for a bad spec."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(hit)
                return done
            fut = self._inflight.get(spec)
            if fut is None:
                self.misses += 1
                fut = self._pool.submit(self._compile_and_store, spec)
                self._inflight[spec] = fut
            return fut

    def _compile_and_store(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile_uncached(spec)
        finally:
            with self._lock:
                self._inflight.pop(spec, None)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        c = self._compiler
        try:
            if spec.kind == "json_object":
                if spec.any_whitespace:
                    return c.compile_builtin_json_grammar()
                return c.compile_grammar(json_schema_grammar('{"type":"object"}', False))
            if spec.kind == "json_schema":
                return c.compile_grammar(json_schema_grammar(spec.source, spec.any_whitespace))
            if spec.kind == "regex":
                return c.compile_regex(spec.source)
            return c.compile_grammar(spec.source)
        except Exception as e:
            raise ValueError(f"invalid {spec.kind}: {_first_line(e)}") from None

    # ------------------------------------------------------------------ matching
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 bitmask of ``rows`` x ceil(vocab_size / 32) (bit set = token allowed)."""
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_masks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """Fill ``bitmask[rows[i]]`` for ``matchers[i]``, threads sharing the work."""
        self._batch.batch_fill_next_token_bitmask(
            [m._m for m in matchers], bitmask, indices=list(rows)
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_bitmask_rows(
    logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, rows: dict[int, int]
) -> None:
    """Set the disallowed tokens of ``logits[r]`` to ``-inf`` in place, by ``bitmask[k]`` for
    each ``r -> k`` of ``rows`` (columns past ``vocab_size`` too); other rows are untouched.

    Work is proportional to the 32-token words that are neither all allowed nor all refused,
    not to the vocabulary: a grammar's mask is mostly whole words (inside a JSON string nearly
    every token is allowed; between values a handful are). A row with few allowed tokens is
    refilled with ``-inf`` around them; otherwise only the refused tokens are written.
    (xgrammar's CPU kernel tests every bit: ~0.6 ms a row at 151,936 tokens.)"""
    if logits.shape[-1] < vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, grammar vocab is {vocab_size}")
    if not rows:
        return
    if logits.device.type != "cpu":
        _apply_bitmask_rows_on_device(logits, bitmask, vocab_size, rows)
        return
    if logits.dtype != torch.float32:  # numpy has no bf16: the same through a float32 copy
        tmp = logits.float()
        apply_bitmask_rows(tmp, bitmask, vocab_size, rows)
        logits.copy_(tmp)
        return
    if vocab_size <= _SMALL_VOCAB:  # xgrammar's kernel: one call, no per-row Python
        lrows = list(rows)
        gathered = bitmask[list(rows.values())]
        if lrows != list(range(len(lrows))):
            gathered = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
            gathered[lrows] = bitmask[list(rows.values())]
        xgr.apply_token_bitmask_inplace(logits, gathered, vocab_size=vocab_size, indices=lrows)
        if logits.shape[-1] > vocab_size:
            logits[lrows, vocab_size:] = float("-inf")
        return
    # numpy, single-threaded: a parallel torch op per row waits on the whole OpenMP pool,
    # which costs a scheduler quantum whenever another process holds a core
    table = logits.numpy()
    words_all = bitmask.numpy()
    n_words = -(-vocab_size // 32)
    neg_inf = np.float32("-inf")
    for r, k in rows.items():
        words = words_all[k, :n_words]
        row = table[r]
        row[vocab_size:] = neg_inf
        if np.count_nonzero(words) * 4 < n_words:  # mostly refused: keep the allowed ones only
            ids = _bit_positions(words, words != 0, want_set=True, limit=vocab_size)
            values = row[ids]
            row[:vocab_size] = neg_inf
            row[ids] = values
        else:
            ids = _bit_positions(words, words != -1, want_set=False, limit=vocab_size)
            row[ids] = neg_inf


def _apply_bitmask_rows_on_device(
    logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, rows: dict[int, int]
) -> None:
    """``apply_bitmask_rows`` where the logits are (a GPU): the rows' mask words are copied
    there, unpacked to one flag per token and applied in one masked fill, with no read back."""
    n_words = -(-vocab_size // 32)
    words = bitmask[list(rows.values()), :n_words].to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    index = torch.tensor(list(rows), dtype=torch.long).to(logits.device, non_blocking=True)
    refused = torch.ones(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
    refused[:, :vocab_size] = ~allowed
    logits[index] = logits[index].masked_fill(refused, float("-inf"))


def _bit_positions(words: np.ndarray, pick: np.ndarray, want_set: bool, limit: int) -> np.ndarray:
    """Token ids (< ``limit``) whose bit is set (``want_set``) or clear, among the words
    ``pick`` selects (int64)."""
    at = np.flatnonzero(pick)
    if not at.size:
        return np.empty(0, dtype=np.int64)
    chosen = words[at]
    if not want_set:
        chosen = np.invert(chosen)
    bits = np.unpackbits(chosen.view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    word, bit = np.nonzero(bits)
    ids = at[word].astype(np.int64) * 32 + bit
    return ids[ids < limit] if ids.size and ids[-1] >= limit else ids


MAX_SPACE_TOKENS = 4  # whitespace tokens a gated reply may put between the end tag and its answer


class GateVocab:
    """What a ``ReasoningGate`` needs of one vocabulary: each token's bytes (to find the end
    tag in the generated text, whatever tokens spell it), the tokens whose text is the start
    tag, and a bitmask row of the whitespace-only tokens (free between the end tag and the
    grammar's first token, as the reasoning parser strips them)."""

    def __init__(self, decoded: Sequence[bytes], vocab_size: int, gate: ReasoningGate) -> None:
        self.end = gate.end.encode()
        self.token_bytes = list(decoded)
        start = gate.start.encode()
        self.start_ids = frozenset(i for i, b in enumerate(decoded) if b == start)
        self.space_ids = frozenset(i for i, b in enumerate(decoded) if b and b.isspace())
        n_words = -(-vocab_size // 32)
        self.start_row = _bitmask_row(self.start_ids, n_words)
        self.space_row = _bitmask_row(self.space_ids, n_words)


def _bitmask_row(ids: frozenset[int], n_words: int) -> np.ndarray:
    """An int32 bitmask row (xgrammar's layout: bit i % 32 of word i // 32) with ``ids`` set."""
    bits = np.zeros(n_words * 32, dtype=np.uint8)
    bits[[i for i in sorted(ids) if i < bits.size]] = 1
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view(np.int32)[:, 0]


class GrammarMatcher:
    """One request's grammar state. Per decode step: its mask filled by
    ``GrammarCompiler.fill_masks`` (with the batch's other matchers) and applied by
    ``apply_bitmask_rows``, sample, ``accept(token)``; finish the request when
    ``is_terminated()``. Not thread-safe (one request, one thread).

    With a reasoning gate (``core.ReasoningGate``, its vocabulary tables ``vocab``) the reply
    goes through phases: ``start`` (the grammar's tokens or the start tag), ``thinking`` (no
    mask: ``constrains()`` is False; the end tag is looked for in the bytes generated), ``after``
    (the end tag seen: the grammar's tokens or whitespace, at most ``MAX_SPACE_TOKENS`` of
    it), ``grammar``. In ``start`` and ``after`` the mask is the grammar's with
    ``extra_allowed()`` added."""

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        vocab_size: int,
        vocab: GateVocab | None = None,
        thinking: bool = False,
    ) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(self._m.stop_token_ids)
        self.vocab = vocab
        self.phase = "grammar" if vocab is None else "thinking" if thinking else "start"
        self._tail = b""  # thinking: the generated bytes that may begin the end tag
        self._spaces = 0  # whitespace tokens taken after the end tag

    def constrains(self) -> bool:
        """Whether the next token is masked (everything but ``thinking``)."""
        return self.phase != "thinking"

    def extra_allowed(self) -> np.ndarray | None:
        """A bitmask row of tokens allowed beside the grammar's next ones (None: none)."""
        if self.phase == "start":
            return self.vocab.start_row
        if self.phase == "after":
            return self.vocab.space_row
        return None

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (the matcher
        is then unchanged)."""
        if not 0 <= token_id < self.vocab_size:
            return False
        token_id = int(token_id)
        if self.phase == "thinking":
            return self._think(token_id)
        if self.phase == "start":
            if token_id in self.vocab.start_ids:
                self.phase = "thinking"
                return True
        elif self.phase == "after" and token_id in self.vocab.space_ids:
            self._spaces += 1
            if self._spaces >= MAX_SPACE_TOKENS:
                self.phase = "grammar"  # no endless blank line before the answer
            return True
        if not self._m.accept_token(token_id):
            return False
        self.phase = "grammar"
        return True

    def _think(self, token_id: int) -> bool:
        end = self.vocab.end
        spelled = self.vocab.token_bytes
        text = self._tail + (spelled[token_id] if token_id < len(spelled) else b"")
        at = text.find(end)
        if at < 0:
            self._tail = text[len(text) - len(end) + 1 :] if len(text) >= len(end) else text
            return True
        rest = text[at + len(end) :].lstrip()  # what the token spelled past the tag
        if rest and not self._m.accept_string(rest):
            return False
        self._tail = b""
        self.phase = "grammar" if rest else "after"
        return True

    def is_terminated(self) -> bool:
        """True once a stop token was accepted at a point where the grammar is complete."""
        return bool(self._m.is_terminated())
