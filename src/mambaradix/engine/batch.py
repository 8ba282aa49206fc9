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
    seconds: float = 0.0  # the forward and its sampling, on the runner's thread
    extend_tokens: int = 0  # tokens the forward computed (prefill + decode rows)
    recorded: bool = False  # a step graph was recorded in it (its time is not a step's)


class Runner(Protocol):
    """What the scheduler needs of a runner: batches run strictly in submission order."""

    def submit(self, batch: RunBatch) -> Future: ...

    def shutdown(self) -> None: ...
