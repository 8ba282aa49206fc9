"""Shared vocabulary of mambaradix: small typed records passed between the layers.

The cache layer, the models and the engine all speak in these types; none of them
imports an upper layer to do so.

A request's regions in one forward::

    |<------ prefix_len (KV in pool, state in working slot) ------>|<-- extend_len (new) -->|
    0                                                        prefix_len               seq_len
                                                 snapshot at offset n: state after prefix_len+n
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

# --------------------------------------------------------------------------- memory specs


@dataclass(frozen=True, slots=True)
class KVSpec:
    """Shape of the attention KV a model needs per token (only attention layers count)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True, slots=True)
class StateLayerSpec:
    """Recurrent state of one layer: a conv state and, where the mixer has one, a temporal state.

    conv_shape is ``(conv_dim, kernel_size - 1)``; temporal_shape is Mamba2
    ``(heads, head_dim, d_state)`` or GDN ``(v_heads, k_dim, v_dim)``; ``None`` for short conv.
    """

    conv_shape: tuple[int, ...]
    temporal_shape: tuple[int, ...] | None = None
    conv_dtype: torch.dtype = torch.float32
    temporal_dtype: torch.dtype = torch.float32

    def nbytes(self) -> int:
        def size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
            n = 1
            for d in shape:
                n *= d
            return n * torch.empty((), dtype=dtype).element_size()

        total = size(self.conv_shape, self.conv_dtype)
        if self.temporal_shape is not None:
            total += size(self.temporal_shape, self.temporal_dtype)
        return total


@dataclass(frozen=True, slots=True)
class StateSpec:
    """Model-agnostic description of a state slot: one entry per recurrent layer, in order."""

    layers: tuple[StateLayerSpec, ...]

    def slot_bytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


# --------------------------------------------------------------------------- requests


MAX_TOP_LOGPROBS = 20
SEED_LIMIT = 1 << 63  # torch.Generator.manual_seed takes a signed 64-bit value
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


class FieldError(ValueError):
    """A bad value a user sent: ``field`` names it (a dotted path), the message says why; an
    API turns ``field`` into its own name for the field, never by reading the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A request's output grammar (structured output), as plain data: ``engine.grammar``
    compiles it (this module must not import the grammar library). ``source``: the schema as
    compact JSON (key order kept), the regex, or the EBNF text ("" for ``json_object``).
    ``any_whitespace``: JSON may carry free whitespace between tokens (False: the compact form
    ``{"a":1,"b":[2,3]}`` only, which also bounds the output of a schema whose strings and
    arrays are bounded)."""

    kind: str
    source: str = ""
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {GRAMMAR_KINDS}")

    @classmethod
    def from_json_schema(cls, schema: dict | bool, any_whitespace: bool = False) -> GrammarSpec:
        """The ``json_schema`` spec of a schema object, its source in one canonical form
        (compact, key order kept: properties are generated in the schema's order), so that one
        schema sent as an object or as JSON text is one cache entry."""
        source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        return cls("json_schema", source, any_whitespace)


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """Where a request's ``grammar`` begins when its reply reasons first (``--reasoning-parser``
    on the chat route; SGLang's reasoner grammar): the text up to ``end`` is free, whitespace
    right after it too, and the grammar applies from the next token on. ``thinking``: the reply
    starts inside the block (its prompt left one open); otherwise it may open one with a
    single token whose text is ``start`` (the grammar's own tokens are allowed beside it), and
    any other first token begins the grammar."""

    start: str = "<think>"
    end: str = "</think>"
    thinking: bool = True

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("a reasoning gate needs non-empty start and end tags")


@dataclass(slots=True)
class SamplingParams:
    """How one request samples. Logprobs are of the model's own distribution (before
    ``logit_bias``, penalties, temperature and filters), like vLLM's default and OpenAI's.

    ``top_logprobs``: alternatives reported per sampled token (with ``return_logprob``).
    ``prompt_logprob_start``: report the logprob of every prompt token from this position on
    (>= 1; -1: none); such a request is never resumed from the cache past
    ``prompt_logprob_start - 1``, so its logits exist. ``prompt_top_logprobs``: alternatives per
    prompt token. ``logit_bias``: token id -> value added to its logit. ``repetition_penalty``
    applies to prompt and output tokens, ``presence_penalty`` / ``frequency_penalty`` to output
    tokens (OpenAI's definition). ``min_tokens``: EOS and ``stop_token_ids`` are masked until
    that many tokens exist (where a ``grammar`` allows nothing else, it ends the output
    anyway). ``grammar``: the output must match it (constrained decoding; the request finishes
    when the grammar is complete and the model ends it); ``reasoning_gate``: from the end of
    the reply's reasoning block on only (``ReasoningGate``). ``thinking_budget``: the most
    tokens the reply reasons inside the gate's block (-1: no cap); at the cap the gate's end
    tag is forced (the rest of it, where the reply had begun writing it), and the reply goes on
    as an answer.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    return_logprob: bool = False
    skip_special_tokens: bool = True
    top_logprobs: int = 0
    prompt_logprob_start: int = -1
    prompt_top_logprobs: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    grammar: GrammarSpec | None = None
    reasoning_gate: ReasoningGate | None = None
    thinking_budget: int = -1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``FieldError`` (a ValueError) naming the bad field; called before a request
        enters the queue."""
        if self.max_new_tokens < 1:
            raise FieldError(
                "max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}"
            )
        if not (self.temperature >= 0.0):
            raise FieldError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise FieldError("top_k", f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise FieldError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < SEED_LIMIT):
            raise FieldError("seed", f"seed must be in [0, 2^63), got {self.seed}")
        for name in ("top_logprobs", "prompt_top_logprobs"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_TOP_LOGPROBS:
                raise FieldError(name, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        if self.prompt_logprob_start != -1 and self.prompt_logprob_start < 1:
            raise FieldError(
                "prompt_logprob_start",
                f"prompt_logprob_start must be -1 (off) or >= 1, got {self.prompt_logprob_start}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise FieldError(name, f"{name} must be in [-2, 2], got {value}")
        if not (0.0 < self.repetition_penalty <= 10.0):
            raise FieldError(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
            )
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise FieldError(
                "min_tokens",
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens}",
            )
        for tok, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= tok < vocab_size:
                raise FieldError(
                    "logit_bias", f"logit_bias token id {tok} is out of range [0, {vocab_size})"
                )
            if not (-100.0 <= bias <= 100.0):
                raise FieldError(
                    "logit_bias", f"logit_bias value for token {tok} must be in [-100, 100]"
                )
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise FieldError(
                "grammar", f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}"
            )
        if self.thinking_budget < -1:
            raise FieldError(
                "thinking_budget",
                f"thinking_budget must be -1 (no cap) or >= 0, got {self.thinking_budget}",
            )
        if self.reasoning_gate is not None and not isinstance(self.reasoning_gate, ReasoningGate):
            raise FieldError("reasoning_gate", "reasoning_gate must be a ReasoningGate")
        if self.reasoning_gate is None and self.thinking_budget >= 0:
            raise FieldError("thinking_budget", "thinking_budget needs a reasoning_gate")
        if self.reasoning_gate is not None and self.grammar is None and self.thinking_budget < 0:
            raise FieldError(
                "reasoning_gate", "reasoning_gate does something only beside a grammar or a "
                "thinking_budget"
            )  # fmt: skip
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if not 0 <= tok < vocab_size:
                    raise FieldError(
                        "stop_token_ids",
                        f"stop_token_ids: token id {tok} is out of range [0, {vocab_size})",
                    )

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprob_start >= 1

    @property
    def processes_logits(self) -> bool:
        """Whether sampling must change the logits (bias, penalties, min_tokens, a thinking
        budget)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.thinking_budget >= 0
        )


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_new_tokens or context length
    ABORT = "abort"
    ERROR = "error"  # this request failed (a fault while handling it, or the engine died)


# --------------------------------------------------------------------------- scheduler -> runner


# --------------------------------------------------------------------------- snapshot strategies

NO_BUFFER = "no_buffer"  # one working slot; a snapshot is a deferred copy at a forward boundary
EXTRA_BUFFER = "extra_buffer"  # + two tracking slots written inside the forward, donated
STRATEGIES = (NO_BUFFER, EXTRA_BUFFER)


def state_slots_per_request(strategy: str, cache_enabled: bool = True) -> int:
    """State slots a running request holds: its working slot, and under ``extra_buffer`` (with
    the cache on) the two tracking slots the forward writes snapshots into."""
    return 3 if cache_enabled and strategy == EXTRA_BUFFER else 1


@dataclass(slots=True)
class StateOps:
    """Deferred state operations, executed by the runner before any layer reads a state.

    ``writes`` (prefixes loaded from the storage tier into their KV and state slots) run
    first, then copies, then clears; a slot never appears as both a copy destination and a
    clear. Pool writes of loads wait for the runner because a forward in flight may still read
    a slot a load was given (KV freed by an insert's de-duplication is reused at once).
    """

    copy_src: list[int] = field(default_factory=list)
    copy_dst: list[int] = field(default_factory=list)
    clear: list[int] = field(default_factory=list)
    writes: list[Callable[[], None]] = field(default_factory=list)

    def add_copy(self, src: int, dst: int) -> None:
        self.copy_src.append(src)
        self.copy_dst.append(dst)

    def extend(self, other: StateOps) -> None:
        self.copy_src.extend(other.copy_src)
        self.copy_dst.extend(other.copy_dst)
        self.clear.extend(other.clear)
        self.writes.extend(other.writes)

    def __bool__(self) -> bool:
        return bool(self.copy_src or self.clear or self.writes)


@dataclass(slots=True)
class ForwardReq:
    """One request's part of a forward.

    ``kv_slots`` holds the KV slot of every token 0 .. prefix_len + len(input_ids): the first
    prefix_len are read, the rest are written by this forward. ``snapshots`` lists
    ``(n, slot)``: write the recurrent state after the first n new tokens (1 <= n <= extend_len)
    into state slot ``slot``. ``state_slot`` is the working slot: it holds the state at
    prefix_len on entry and the state at prefix_len + extend_len on exit. ``all_logits``: the
    model returns logits for every new token of this request, not only the last (prompt
    logprobs).
    """

    prefix_len: int
    input_ids: list[int]
    kv_slots: torch.Tensor
    state_slot: int
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    all_logits: bool = False

    @property
    def extend_len(self) -> int:
        return len(self.input_ids)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + len(self.input_ids)


@dataclass(slots=True)
class ForwardBatch:
    """What the scheduler hands the runner: requests (prefills and decodes mixed) + state ops.
    The runner turns it into a ``layout.ForwardLayout`` once per forward."""

    reqs: list[ForwardReq]
    state_ops: StateOps = field(default_factory=StateOps)
    # Optional [Td, L]: the KV slot rows of the first Td requests, all decodes, as the scheduler
    # gathered them in one go (request i's slots are row i's first seq_len entries; entries past
    # them are any valid slot). Saves rebuilding the decode slot table request by request.
    decode_table: torch.Tensor | None = None
