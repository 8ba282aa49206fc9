"""Decode step graphs: a decode-only forward recorded once per shape and replayed after that.

A batch-1 decode step of a real-size model is 120-210 native kernel calls. The kernels stream
the weights at the machine's speed; the Python between them (layers, op wrappers, tensor
allocations, ~10 us a call, run with caches the weight stream flushed) cost 20-30% of the step
(``bench/bench_decode_parts.py``, "native calls alone"). So, as GPU engines replay a captured
CUDA graph (SGLang's ``--disable-cuda-graph``, ``--cuda-graph-max-bs``), the runner records
a decode forward of a shape once and from then on replays it::

    step N (shape seen)  layout -> model.forward, recorded  -> logits   (the normal forward)
    step N+1, N+2, ...   layout -> inputs written into the recorded layout's tensors
                                -> the recorded calls, in order           -> logits

A key is recorded on its second step in a row (a batch that lasts one step, as batches do
while requests join and finish, is not worth a recording, which costs about one more step).
A shape (the key) is the batch size, the capacity of the KV slot table (a power of two that
covers every request's length; the recorded table is that wide and each step's rows are
written into it), the positions of each request (a speculative verify step is a decode of
several positions, ``layout.DecodeRows``: its last token and drafts, the state after each
written into that position's slot; the slots are written in like the working slots) and the
structure of the backend's per-forward tensors (``replay_key``: for
the cascade decode attention plan, each shared-prefix piece's length, groups and width; those
tensors are written in like the layout's). What a replay runs:

- every native call (``kernels.native.recording``: the ctypes boundary), with the recorded
  arguments, so over the recorded buffers;
- every torch op that computes something (seen by a ``TorchDispatchMode``): in-place ops as
  recorded; the others into the tensor they returned when recorded (their ``out=`` variant
  where it gives the same values, else a copy). Views and allocations run only once.

Every tensor the recording saw stays alive with the graph, so every pointer stays valid; the
graph's tensors are checked to hold every pointer its native calls pass. A recording is
refused (the key runs the Python path from then on, the reason logged once; after
``REFUSALS_TO_STOP`` keys refused for one reason, a reason of the model's, nothing more is
recorded) where a replay
could not give the Python path's result: Python read a tensor's data (``item``, ``bool``,
``tolist``) or built a tensor from Python values, an op's output shape or values depend on
more than its inputs (``nonzero``, random ops), a native call returned a value Python reads
(an fp32 MoE's padded pair layout), or a native call reads memory the graph does not hold.
Steps with prefill rows or with a snapshot copied after the step (a decode's at its last
position: the decode interval's) are never replayed, nor those the backend's ``replay_key``
refuses.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mambaradix.kernels import native
from mambaradix.kernels.backend import KernelBackend
from mambaradix.layout import ForwardContext, ForwardLayout

logger = logging.getLogger(__name__)

MIN_TABLE = 256  # smallest KV slot table a graph is recorded with (columns)
REFUSALS_TO_STOP = 3  # keys refused for the same reason before recording stops altogether
MAX_GRAPHS = 8  # graphs kept (least recently replayed dropped first) ...
MAX_GRAPH_BYTES = 512 << 20  # ... and the bytes their step tensors may hold together (the
# logits dominate: [batch, vocab] in the model dtype and fp32, ~40 MB at batch 16 for a
# 248k-token vocabulary)

_aten = torch.ops.aten
_ALLOCATIONS = {
    _aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default,
    _aten.empty_strided.default, _aten.new_empty_strided.default,
}  # fmt: skip
# ops through which Python reads or writes a tensor's values outside the dispatcher
_PYTHON_DATA = {
    _aten.lift_fresh.default: "a tensor built from Python values",
    _aten.resolve_conj.default: "Python read a tensor's values (tolist)",
    _aten.resolve_neg.default: "Python read a tensor's values (tolist)",
}
_REFUSED_TAGS = {
    torch.Tag.data_dependent_output: "Python read a tensor's data",
    torch.Tag.dynamic_output_shape: "an output shape depends on the data",
    torch.Tag.nondeterministic_seeded: "a random op",
}
_DROPOUT_ONLY = {_aten._scaled_dot_product_flash_attention_for_cpu.default}  # random if p > 0


class RecordingRefused(Exception):
    """A forward that cannot be replayed (the message says why)."""


@dataclass(slots=True)
class StepGraph:
    """One recorded decode step: ``replay`` writes a step's inputs into ``layout`` (the
    recorded layout) and runs ``program`` (the recorded calls); ``logits`` then holds the
    step's logits (the same tensor every replay: read it before the next)."""

    key: tuple
    layout: ForwardLayout
    logits: torch.Tensor
    program: list[tuple[Callable, tuple]]
    kept: list = field(repr=False)  # every object the recording saw
    nbytes: int = 0  # bytes of the tensors the recorded step allocated
    native_calls: int = 0
    torch_ops: int = 0

    def replay(self, layout: ForwardLayout, backend: KernelBackend) -> torch.Tensor:
        write_inputs(self.layout, layout)
        backend.write_replay_inputs(self.layout, layout)
        for fn, args in self.program:
            fn(*args)
        return self.logits


def write_inputs(recorded: ForwardLayout, layout: ForwardLayout) -> None:
    """Copy a decode step's per-step tensors into the recorded layout's: the token ids,
    positions, the KV slots written, the working state slots (and each position's slot of a
    decode of several), the sequence lengths and the KV slot table (its first columns; the rest
    keep older slots, which are valid and unread). (Each request's row offsets ``cu`` follow
    from its positions, which are part of the key.)"""
    recorded.input_ids.copy_(layout.input_ids)
    recorded.positions.copy_(layout.positions)
    recorded.out_kv_slots.copy_(layout.out_kv_slots)
    dst, src = recorded.decode, layout.decode
    dst.state_slots.copy_(src.state_slots)
    if src.row_slots is not None:
        dst.row_slots.copy_(src.row_slots)
    dst.seq_lens.copy_(src.seq_lens)
    if src.kv_table is not None:
        dst.kv_table[:, : src.kv_table.shape[1]].copy_(src.kv_table)


def table_capacity(max_seq_len: int) -> int:
    """The KV slot table width a graph records for requests up to ``max_seq_len`` long."""
    return max(MIN_TABLE, 1 << max(0, max_seq_len - 1).bit_length())


class DecodeGraphs:
    """The runner's step graphs. ``forward(ctx)`` returns the logits of a decode forward that
    was replayed or recorded, or None when the caller must run the model itself.

    Contract: the model, its backend and the pools never change under a graph; the caller
    built ``ctx.layout`` for this step and ran ``backend.prepare`` on it."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: KernelBackend,
        kv_pool: object,
        state_pool: object,
        max_batch: int,
        max_graphs: int = MAX_GRAPHS,
        max_bytes: int = MAX_GRAPH_BYTES,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.max_batch = max_batch
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        k = getattr(kv_pool, "k", None)
        self._kv_heads = int(k[0].shape[1]) if k else 0
        self._graphs: OrderedDict[tuple, StepGraph] = OrderedDict()
        self._refused: dict[tuple, str] = {}
        self.stopped: str | None = None  # why nothing is recorded any more
        self._previous: tuple | None = None  # the key of the step before
        self._static_spans: set[tuple[int, int]] | None = None  # model's and pools' memory
        self.stats: Counter[str] = Counter()  # recorded, replayed, python (+ refused reasons)

    @property
    def graphs(self) -> list[StepGraph]:
        return list(self._graphs.values())

    @property
    def nbytes(self) -> int:
        """Bytes the kept graphs' step tensors hold."""
        return sum(g.nbytes for g in self._graphs.values())

    def key(self, layout: ForwardLayout) -> tuple[int, int, tuple[int, ...]] | None:
        """The batch, table capacity and positions per request (``()``: one each) of a decode
        forward over ``layout``, or None (not a decode step of at most ``max_batch`` requests
        without snapshot copies); the backend's ``replay_key`` completes a graph's key."""
        dec = layout.decode
        if layout.prefill is not None or dec is None or not dec.rows.whole:
            return None
        if dec.num_copies or len(dec.reqs) > self.max_batch:
            return None
        width = 0
        if dec.kv_table is not None:
            width = table_capacity(max(r.seq_len for r in layout.reqs))
        return len(dec.reqs), width, tuple(dec.widths) if dec.multi else ()

    def forward(self, ctx: ForwardContext) -> torch.Tensor | None:
        layout = ctx.layout
        shape = self.key(layout)
        if shape is None:
            return None
        structure = self.backend.replay_key(layout, self._kv_heads)
        if structure is None:
            self.stats["python"] += 1
            return None
        key = (*shape, structure)
        previous, self._previous = self._previous, key
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            self.stats["replayed"] += 1
            return graph.replay(layout, self.backend)
        if key in self._refused or self.stopped or key != previous:
            self.stats["python"] += 1
            return None
        return self._record(key, ctx)

    def _record(self, key: tuple, ctx: ForwardContext) -> torch.Tensor:
        """Run the forward of ``ctx`` recorded (over a KV table ``key[1]`` wide), keep the graph
        unless refused; the forward's logits either way."""
        layout = ctx.layout
        dec = layout.decode
        if dec.kv_table is not None and dec.kv_table.shape[1] != key[1]:
            table = dec.kv_table.new_zeros(dec.kv_table.shape[0], key[1])
            table[:, : dec.kv_table.shape[1]] = dec.kv_table
            dec.kv_table = table
            self.backend.prepare(layout)  # its per-forward tensors over the recorded table
            if self.backend.replay_key(layout, self._kv_heads) != key[-1]:
                return self.model.forward(ctx)  # (an attention plan cannot change with the width)
        t0 = time.perf_counter()
        with native.recording() as calls, _Recorder(calls) as recorder:
            logits = self.model.forward(ctx)
        try:
            graph = _build(key, layout, logits, calls, recorder, self._static_spans_with(layout))
        except RecordingRefused as e:
            self._refused[key] = str(e)
            self.stats["refused: " + str(e)] += 1
            if self.stats["refused: " + str(e)] >= REFUSALS_TO_STOP:
                self.stopped = str(e)
                logger.info("decode steps are no longer recorded: %s", e)
            logger.info("decode step of %d requests (%s) not replayable: %s", key[0], key[2], e)
            return logits
        self._graphs[key] = graph
        while len(self._graphs) > 1 and (
            len(self._graphs) > self.max_graphs or self.nbytes > self.max_bytes
        ):
            self._graphs.popitem(last=False)  # the least recently replayed
        self.stats["recorded"] += 1
        logger.info(
            "decode graph recorded in %.0f ms: %d requests (positions %s), KV table %d wide, "
            "%d native calls and %d torch ops, %.1f MB of step tensors",
            (time.perf_counter() - t0) * 1e3, key[0], key[2] or "1 each", key[1],
            graph.native_calls, graph.torch_ops, graph.nbytes / 1e6,
        )  # fmt: skip
        return logits

    def _static_spans_with(self, layout: ForwardLayout) -> set[tuple[int, int]]:
        """The memory of the tensors that outlive every step: the model's and the pools' (read
        once), the recorded layout's and the backend's per-forward tensors for it."""
        if self._static_spans is None:
            tensors = [*self.model.parameters(), *self.model.buffers()]
            for module in self.model.modules():
                tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
            for pool in (self.kv_pool, self.state_pool):
                for name in ("k", "v", "conv", "temporal"):
                    tensors += [t for t in getattr(pool, name, None) or () if t is not None]
            self._static_spans = {_storage_span(t) for t in tensors}
        return self._static_spans | {_storage_span(t) for t in _tensors_in(layout, depth=3)}


def _tensors_in(obj: object, depth: int) -> Iterable[torch.Tensor]:
    """Tensors reachable from ``obj``'s fields (dataclasses, slots, dicts, lists), ``depth``
    levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth == 0 or obj is None or isinstance(obj, (int, float, str, bool, torch.device)):
        return
    if isinstance(obj, dict):
        children: Iterable = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    else:
        names = getattr(type(obj), "__slots__", ()) or getattr(obj, "__dict__", {}).keys()
        children = (getattr(obj, n, None) for n in names)
    for child in children:
        yield from _tensors_in(child, depth - 1)


class _Recorder(TorchDispatchMode):
    """Every torch op of the forward with its arguments and result, and how many native calls
    came before it (so the two streams merge in their order)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # nothing is compiled under this mode; the default wraps __torch_dispatch__ in a
        # dynamo guard whose first call imports torch._dynamo (~2 s at start-up)
        return False

    def __init__(self, calls: list[native.NativeCall]) -> None:
        super().__init__()
        self.ops: list[tuple[int, object, tuple, dict, object]] = []
        self.calls = calls  # the list native.recording() fills

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((len(self.calls), func, args, kwargs, out))
        return out


def _flat_tensors(values: Iterable) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_flat_tensors(v))
    return out


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _without_dropout(func, args: tuple, kwargs: dict) -> bool:
    """An attention op whose only randomness is its dropout, called with none."""
    if func not in _DROPOUT_ONLY:
        return False
    p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    return p == 0.0


def _aliases_input(args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> bool:
    """Whether every output shares its memory with an input (decided by the memory: ops like
    ``to`` may or may not return a new tensor)."""
    inputs = {_storage_span(t)[0] for t in _flat_tensors([*args, *kwargs.values()])}
    return all(_storage_span(o)[0] in inputs for o in outs)


def _replay_op(func, args: tuple, kwargs: dict, out) -> tuple[Callable, tuple] | None:
    """How a replay reruns torch op ``func`` (None: it need not: a view, an allocation, or a
    result that is one of its inputs). Raises RecordingRefused for ops a replay cannot rerun."""
    name = str(func)
    if func in _PYTHON_DATA:
        raise RecordingRefused(f"{_PYTHON_DATA[func]} ({name})")
    for tag, why in _REFUSED_TAGS.items():
        if tag in func.tags and not (
            tag is torch.Tag.nondeterministic_seeded and _without_dropout(func, args, kwargs)
        ):
            raise RecordingRefused(f"{why} ({name})")
    if func in _ALLOCATIONS:
        return None
    if func.overloadpacket is _aten.result_type:
        return None  # a dtype from the inputs' dtypes: the same every step
    mutable = func._schema.is_mutable
    outs = [out] if isinstance(out, torch.Tensor) else out
    if not isinstance(outs, (list, tuple)) or not all(isinstance(o, torch.Tensor) for o in outs):
        if mutable and out is None:
            return functools.partial(func, *args, **kwargs), ()
        raise RecordingRefused(f"Python read a tensor's data ({name} returned {type(out)})")
    if mutable:
        return functools.partial(func, *args, **kwargs), ()
    if _aliases_input(args, kwargs, outs):
        return None  # a view of its input, or the input itself (``to`` a dtype it has)
    if len(outs) == 1:
        o = outs[0]
        if func in (_aten.to.dtype, _aten._to_copy.default) and o.shape == args[0].shape:
            return o.copy_, (args[0],)
        rerun = _out_variant(func, args, kwargs, o)
        if rerun is not None:
            return rerun, ()

    def rerun_copy() -> None:
        got = func(*args, **kwargs)
        for o, g in zip(outs, [got] if isinstance(got, torch.Tensor) else got):
            o.copy_(g)

    return rerun_copy, ()


def _out_variant(func, args: tuple, kwargs: dict, out: torch.Tensor) -> Callable | None:
    """``func``'s ``out=`` overload writing into ``out``, if it has one that gives the same
    values (tried once here, right after the op ran, so its inputs are as they were)."""
    overload = getattr(func.overloadpacket, "out", None)
    if overload is None:
        return None
    names = {a.name for a in overload._schema.arguments}
    if "out" not in names:
        return None
    kw = {k: v for k, v in kwargs.items() if k in names}
    trial = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
    ptr = trial.data_ptr()
    try:
        overload(*args, **kw, out=trial)
    except Exception:
        return None
    # the same values, written in place (a resize would move a recorded tensor's memory)
    if trial.data_ptr() != ptr or trial.stride() != out.stride() or not torch.equal(trial, out):
        return None
    return functools.partial(overload, *args, **kw, out=out)


def _build(
    key: tuple,
    layout: ForwardLayout,
    logits: torch.Tensor,
    calls: list[native.NativeCall],
    recorder: _Recorder,
    static: set[tuple[int, int]],
) -> StepGraph:
    """The graph of a recorded step. ``static``: the memory spans of the tensors that outlive
    every step."""
    kept: list = [layout, logits, recorder.ops]
    program: list[tuple[Callable, tuple]] = []
    spans = set(static)
    made: dict[int, int] = {}  # storages the step allocated: start -> bytes
    steps: list[tuple[int, tuple[Callable, tuple]]] = []  # (native calls before, entry)
    for before, func, args, kwargs, out in recorder.ops:
        entry = _replay_op(func, args, kwargs, out)
        spans.update(_storage_span(t) for t in _flat_tensors([*args, *kwargs.values(), out]))
        # new memory: an allocation's, or a computing op's that is not in place
        fresh = func in _ALLOCATIONS or (entry is not None and not func._schema.is_mutable)
        for t in _flat_tensors([out]) if fresh else ():
            start, end = _storage_span(t)
            made.setdefault(start, end - start)
        if entry is not None:
            steps.append((before, entry))
    widest: dict[int, int] = {}
    for start, end in spans:
        widest[start] = max(widest.get(start, start), end)
    ordered = sorted(widest.items())  # storages never overlap: one span can hold a pointer
    starts = [s for s, _ in ordered]
    for call in calls:
        if call.name in native.DATA_RESULTS:
            raise RecordingRefused(f"Python reads what native {call.name} returns")
        for i in call.pointers:
            p = call.args[i]
            if not p:
                continue
            j = bisect.bisect_right(starts, p) - 1
            if j < 0 or p >= ordered[j][1]:
                raise RecordingRefused(
                    f"native {call.name} reads memory the step's tensors do not hold (argument {i})"
                )
    # merge: the torch ops recorded after n native calls run after the first n of them
    k = 0
    for n, call in enumerate(calls):
        while k < len(steps) and steps[k][0] <= n:
            program.append(steps[k][1])
            k += 1
        program.append((call.function, call.args))
    program.extend(entry for _, entry in steps[k:])
    return StepGraph(key, layout, logits, program, kept, sum(made.values()), len(calls), len(steps))
