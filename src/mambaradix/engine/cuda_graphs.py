"""CUDA graphs of decode steps (SGLang's ``--cuda-graph-bs``, ``--cuda-graph-max-bs``,
``--disable-cuda-graph``): a decode-only forward is captured once per batch-size bucket and KV
table capacity, and replayed after that, so a step is one graph launch instead of hundreds of
kernel launches from Python.

A step of ``n`` requests replays the graph of the smallest captured batch size ``bs >= n``::

    static layout (one per graph)   rows 0 .. n-1      the step's token ids, positions, KV slot
                                                       written, working state slot, length and
                                                       KV slot row, copied in
                                    rows n .. bs-1     padding: token 0 at position 0, written
                                                       into the pools' scratch KV and state
                                                       slots (never handed out), length 1
    replay -> logits[:n]

A speculative verify step (every request with the same ``k + 1`` positions) replays a graph
of its own, keyed by the positions too: padding requests of ``k + 1`` rows, each row's state
slot (``DecodeRows.row_slots``) copied in with the rest, so each position's snapshot is written
inside the graph by the backend's multi-position decode kernels; requests with different
numbers of positions run eagerly.

The backend's per-forward index tensors (``prepare``) are built inside the captured region,
from the static layout's tensors, so they follow every copy. Decode snapshots (a decode's
state after its one token = its working state after the step) are copied after the replay,
outside the graph, as are a verify step's snapshots that no row writes. The first use of a
shape runs the forward once eagerly on padding rows only (Triton compiles its kernels there,
never while capturing) and then captures it.

On a CPU device (the tests) ``capture`` keeps the forward as a Python callable instead of a
CUDA graph: the padding, the static inputs and the snapshot copies are exercised the same way.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import torch

from mambaradix.core import ForwardReq
from mambaradix.engine.step_graph import table_capacity
from mambaradix.kernels.backend import KernelBackend
from mambaradix.kernels.torch_backend import _copy_decode_snapshots
from mambaradix.layout import ForwardContext, ForwardLayout, VerifyReq

logger = logging.getLogger(__name__)

MAX_GRAPHS = 64  # graphs kept (least recently replayed dropped first)


def default_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's shape of buckets: 1, 2, 4, 8, then every 8 up to 256, then every 16."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, max_bs + 1, 16))
    sizes = [s for s in sizes if s <= max_bs]
    if max_bs > 0 and (not sizes or sizes[-1] != max_bs):
        sizes.append(max_bs)
    return sizes


class _Graph:
    """One captured step: its static layout, the replay callable and the logits it writes."""

    def __init__(self, key: tuple[int, int, int], layout: ForwardLayout, replay: Callable[[], None],
                 logits: torch.Tensor, keep: object) -> None:  # fmt: skip
        self.key = key
        self.layout = layout
        self.replay = replay
        self.logits = logits
        self.keep = keep  # the CUDA graph object (or the eager closure) kept alive


class CudaGraphs:
    """The runner's decode graphs on a CUDA device. ``forward(ctx)`` returns the logits of a
    decode step it replayed (or captured and ran), or None where the caller runs the model.

    Contract: the model, the backend and the pools never change under a graph; the pools have
    one scratch state slot and one scratch KV page (``scratch_slot``) for the padding rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: KernelBackend,
        kv_pool: object,
        state_pool: object,
        batch_sizes: list[int],
        device: str | torch.device,
        max_graphs: int = MAX_GRAPHS,
    ) -> None:
        if not batch_sizes:
            raise ValueError("CUDA graphs need at least one batch size")
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.batch_sizes = sorted(set(batch_sizes))
        self.device = torch.device(device)
        self.max_graphs = max_graphs
        self._with_kv = bool(getattr(kv_pool, "k", None))
        self._graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()
        self._mempool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.stats: Counter[str] = Counter()  # recorded, replayed, python
        # why capturing stopped, by kind ("decode steps", "verify steps"): that kind then runs
        # eagerly, the other is still captured
        self.failed: dict[str, str] = {}

    @property
    def graphs(self) -> list[_Graph]:
        return list(self._graphs.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the graphs' static inputs and logits (their private memory pool holds the
        activations too; ``torch.cuda.memory_stats`` reports it)."""
        total = 0
        for g in self._graphs.values():
            total += g.logits.numel() * g.logits.element_size()
        return total

    def key(self, layout: ForwardLayout) -> tuple[int, int, int] | None:
        """The captured batch size, positions per request and KV table width a decode step
        over ``layout`` replays, or None (not a decode-only step, larger than the largest
        bucket, or a verify step whose requests have different numbers of positions)."""
        dec = layout.decode
        if layout.prefill is not None or dec is None or not dec.rows.whole:
            return None
        positions = dec.widths[0] if dec.widths else 1
        if dec.multi and (any(w != positions for w in dec.widths) or layout.logit_rows is not None):
            return None  # (mixed widths run eagerly)
        n = len(dec.reqs)
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            return None
        width = 0
        if dec.kv_table is not None:
            width = table_capacity(max(r.seq_len for r in layout.reqs))
        return self.batch_sizes[i], positions, width

    def forward(self, ctx: ForwardContext) -> torch.Tensor | None:
        layout = ctx.layout
        key = self.key(layout)
        kind = "decode steps" if key is None or key[1] == 1 else "verify steps"
        if key is None or kind in self.failed:
            self.stats["python"] += 1
            return None
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(key, ctx)
            except Exception as e:  # a model or kernel that cannot be captured runs eagerly
                self.failed[kind] = f"{type(e).__name__}: {e}"
                logger.warning("%s will not be captured: %s", kind, self.failed[kind])
                self.stats["python"] += 1
                return None
        else:
            self._graphs.move_to_end(key)
        self._write_inputs(graph.layout, layout)
        graph.replay()
        self.stats["replayed"] += 1
        dec = layout.decode
        if dec.num_copies:  # the snapshots no row writes (a decode's state after its step)
            for t in self._state_tensors():
                _copy_decode_snapshots(t, dec)
        return graph.logits[: layout.num_tokens]

    # ------------------------------------------------------------------ internals

    def _state_tensors(self) -> list[torch.Tensor]:
        pool = self.state_pool
        return [*pool.conv, *(t for t in pool.temporal if t is not None)]

    def _static_layout(self, bs: int, positions: int, width: int) -> ForwardLayout:
        """A decode layout of ``bs`` padding requests of ``positions`` rows each (a verify
        step's where more than one: a snapshot after each but the last), every slot a scratch
        one; its tensors are the graph's."""
        kv_slot = self.kv_pool.scratch_slot if self._with_kv else 0
        kv = torch.full((positions,), kv_slot, dtype=torch.long)
        scratch = self.state_pool.scratch_slot
        if positions == 1:
            reqs = [ForwardReq(0, [0], kv, scratch) for _ in range(bs)]
            table = torch.full((bs, max(width, 1)), kv_slot, dtype=torch.long) if width else None
            return ForwardLayout.build(reqs, self.device, table, with_kv=self._with_kv)
        snaps = [(n, scratch) for n in range(1, positions)]
        reqs = [VerifyReq(0, [0] * positions, kv, scratch, list(snaps), all_logits=True)
                for _ in range(bs)]  # fmt: skip
        static = ForwardLayout.build(reqs, self.device, with_kv=self._with_kv)
        if width:  # one table row per position, as wide as the key says
            rows = bs * positions
            static.decode.kv_table = torch.full((rows, width), kv_slot, device=self.device)
        return static

    def _write_inputs(self, static: ForwardLayout, layout: ForwardLayout) -> None:
        """The step's rows (and requests) into the static layout; the rows and requests past
        them back to padding."""
        n, m = layout.num_tokens, len(layout.decode.reqs)
        dst, src = static.decode, layout.decode
        static.input_ids[:n].copy_(layout.input_ids)
        static.positions[:n].copy_(layout.positions)
        static.out_kv_slots[:n].copy_(layout.out_kv_slots)
        dst.state_slots[:m].copy_(src.state_slots)
        dst.seq_lens[:n].copy_(src.seq_lens)
        if src.multi:  # a verify step: each row's slot (its snapshot's, or the working one)
            dst.row_slots[:n].copy_(src.row_slots)
            dst.row_slots[n:].fill_(self.state_pool.scratch_slot)
        if n < static.num_tokens:
            static.input_ids[n:].fill_(0)
            static.positions[n:].fill_(0)
            dst.seq_lens[n:].fill_(1)
            dst.state_slots[m:].fill_(self.state_pool.scratch_slot)
            if self._with_kv:
                static.out_kv_slots[n:].fill_(self.kv_pool.scratch_slot)
        if src.kv_table is not None:
            dst.kv_table[:n, : src.kv_table.shape[1]].copy_(src.kv_table)
            if n < static.num_tokens:
                dst.kv_table[n:].fill_(self.kv_pool.scratch_slot)

    def _capture(self, key: tuple[int, int, int], ctx: ForwardContext) -> _Graph:
        bs, positions, width = key
        t0 = time.perf_counter()
        static = self._static_layout(bs, positions, width)
        sctx = ForwardContext(static, ctx.kv_pool, ctx.state_pool)

        def step() -> torch.Tensor:
            self.backend.prepare(static)
            return self.model.forward(sctx)

        step()  # eagerly, on padding rows only: Triton compiles here, not while capturing
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                logits = step()
            replay, keep = graph.replay, graph
        else:
            holder = {"logits": step()}

            def replay() -> None:
                holder["logits"].copy_(step())

            logits, keep = holder["logits"], holder
        g = _Graph(key, static, replay, logits, keep)
        self._graphs[key] = g
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        self.stats["recorded"] += 1
        logger.info(
            "decode step captured in %.0f ms: batch %d, %d position(s) each, KV table %d wide",
            (time.perf_counter() - t0) * 1e3, bs, positions, width,
        )  # fmt: skip
        return g
