"""What the scheduler hands the runner (``RunBatch``) and what comes back (``RunResult``).

Both sides import this module; neither imports the other's internals.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mambaradix.core import ForwardBatch, SamplingParams
from mambaradix.engine.sampler import TopLogprobs

FUTURE_STRIDE = 1 << 20


def future_id(batch_id: int, index: int) -> int:
    """Placeholder token for the ``index``-th token sampled by ``batch_id`` (negative)."""
    return -(batch_id * FUTURE_STRIDE + index + 1)


@dataclass(slots=True)
class RunBatch:
    """One forward and its sampling: the scheduler's whole request to the runner."""

    batch_id: int
    forward: ForwardBatch
    sample_rows: list[int] = field(default_factory=list)  # indices into forward.reqs
    params: list[SamplingParams] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    logit_states: list = field(default_factory=list)  # RequestLogits or None per sample row
    grammars: list = field(default_factory=list)  # GrammarMatcher or None per sample row
    # prompt logprobs: (index into forward.reqs, row offset in its segment, target token ids,
    # top-k); that request has ForwardReq.all_logits set
    prompt_rows: list[tuple[int, int, list[int], int]] = field(default_factory=list)
    # speculative decoding: sample row -> the draft tokens its request's forward verifies
    # (that request has ForwardReq.all_logits set: one row per input token)
    drafts: dict[int, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class RunResult:
    batch_id: int
    tokens: list[int]
    logprobs: list[float]
    top: list[TopLogprobs | None] = field(default_factory=list)  # per sample row
    # per RunBatch.prompt_rows entry: the targets' logprobs and each one's top-k (or None)
    prompt: list[tuple[list[float], list[TopLogprobs | None]]] = field(default_factory=list)
    errors: dict[int, BaseException] | None = None  # sample row -> why sampling it raised
    # speculative decoding: sample row -> the tokens its verify step emits and their logprobs
    accepted: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    grammar_ended: set[int] = field(default_factory=set)  # sample rows whose grammar ended
    seconds: float = 0.0  # the forward and its sampling, on the runner's thread (GPU: wait)
    extend_tokens: int = 0  # tokens the forward computed (prefill + decode rows)
    recorded: bool = False  # a step graph was recorded in it (its time is not a step's)
    # tokens and logprobs still on the device (an all-greedy batch on a GPU): ``wait`` reads them
    pending: PendingTokens | None = None

    def wait(self) -> RunResult:
        """The result with its tokens on the host: waits for a pending batch's copy (the one
        host-device sync of such a step), on the caller's thread, not the runner's."""
        if self.pending is not None:
            self.tokens, self.logprobs, seconds = self.pending.read()
            if seconds is not None:
                self.seconds = seconds
            self.pending = None
        return self


class PendingTokens:
    """An all-greedy batch's sampled ids and their logprobs (float64 ``[2, B]``: ids are exact
    in float64) on their way to the host. On a GPU the copy into pinned memory is queued
    without waiting and a CUDA event recorded after it, so the runner goes on to the next
    forward while this one runs; ``read`` waits for that event only. The batch's seconds are
    the GPU's, from ``start`` (an event recorded when the runner began the batch) to the copy's
    end. On a CPU there is nothing to wait for."""

    __slots__ = ("host", "done", "start")

    def __init__(self, pair: torch.Tensor, start: torch.cuda.Event | None = None) -> None:
        self.start = start
        self.done = None
        if pair.device.type == "cuda":
            self.host = torch.empty(pair.shape, dtype=pair.dtype, pin_memory=True)
            self.host.copy_(pair, non_blocking=True)
            self.done = torch.cuda.Event(enable_timing=start is not None)
            self.done.record()
        else:
            self.host = pair

    def read(self) -> tuple[list[int], list[float], float | None]:
        """The tokens, their logprobs and the batch's GPU seconds (None on a CPU)."""
        seconds = None
        if self.done is not None:
            self.done.synchronize()
            if self.start is not None:
                seconds = self.start.elapsed_time(self.done) / 1e3
        ids, lps = self.host.tolist()
        return [int(t) for t in ids], lps, seconds


class Runner(Protocol):
    """What the scheduler needs of a runner: batches run strictly in submission order."""

    def submit(self, batch: RunBatch) -> Future: ...

    def shutdown(self) -> None: ...
