"""What the engine hands back: per-step request outputs, handles to consume them, statistics."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

ENGINE_DEAD = "engine failed"  # how the error of a request failed by the engine's death begins


@dataclass(slots=True)
class RequestOutput:
    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float] | None = None
    finish_matched: str | int | None = None  # on the last event: the stop string or token hit
    # per new token, its best alternatives (ids, logprobs), when the request asks for them
    new_top_logprobs: list | None = None
    # with the first output of a request that asks for prompt logprobs: the logprobs of prompt
    # tokens prompt_logprob_start.. and their top alternatives (None entries without top-k)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list | None = None
    error: str | None = None  # set on the final output of a request that failed
    queue_time: float | None = None  # seconds the request waited before its first admission
    storage_tokens: int = 0  # of cached_tokens, those read back from the storage tier
    spec_verify_ct: int = 0  # speculative verify steps so far, and the tokens they emitted
    spec_accepted: int = 0


def spec_meta(verify_ct: int, accepted: int) -> dict[str, int | float]:
    """SGLang's ``spec_verify_ct`` and the mean tokens a verify step emitted (none without
    speculation)."""
    if not verify_ct:
        return {}
    return {"spec_verify_ct": verify_ct, "spec_accept_length": accepted / verify_ct}


def cached_details(out: RequestOutput) -> dict[str, int]:
    """``cached_tokens`` by tier: found in the RAM pools (``device``, SGLang's name for the
    first tier) or read back from the storage tier."""
    cached = max(0, out.cached_tokens)
    return {"device": cached - out.storage_tokens, "storage": out.storage_tokens}


class RequestError(RuntimeError):
    """One request failed (a fault while handling it); the engine keeps serving the others."""


class EngineDeadError(RuntimeError):
    """The engine itself failed; every running and later request fails with this."""


class RequestHandle:
    """Outputs of one request. Created inside a running asyncio loop, it delivers to
    ``aevents``; otherwise to ``events`` / ``result``."""

    def __init__(self, rid: str, prompt_tokens: int) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._aq: asyncio.Queue | None = asyncio.Queue()
        except RuntimeError:
            self._loop, self._aq = None, None
        self._q: queue.Queue = queue.Queue()

    def _put(self, out: RequestOutput) -> None:
        """Deliver one output now (one wake-up of the handle's event loop per call)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, out)
        else:
            self._q.put(out)

    def events(self) -> Iterator[RequestOutput]:
        while True:
            out = self._q.get()
            yield out
            if out.finished:
                return

    async def aevents(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self._aq.get()
            yield out
            if out.finished:
                return

    def result(self) -> dict:
        """The whole output; raises ``RequestError`` / ``EngineDeadError`` if it failed."""
        return _collect(self.events())


class OutputBatcher:
    """Collects the outputs of one engine step and delivers them together: one
    ``call_soon_threadsafe`` per event loop per step instead of one per output.

    Each cross-thread call writes to the loop's wake-up socket and wakes the loop's thread; with
    a hundred streams that is a hundred syscalls and wake-ups per decode step, work that competes
    with the forward for the CPU. Outputs keep their order within a handle.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[RequestHandle, RequestOutput]] = []

    def put(self, handle: RequestHandle, out: RequestOutput) -> None:
        self._pending.append((handle, out))

    def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for handle, out in pending:
            if handle._loop is None:
                handle._q.put(out)
            else:
                by_loop.setdefault(handle._loop, []).append((handle._aq, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for aq, out in items:
        aq.put_nowait(out)


def _pairs(top: Any) -> list[list[float | int]] | None:
    """A token's alternatives ``(ids, logprobs)`` as ``[[logprob, id], ...]``, best first."""
    return None if top is None else [[lp, t] for t, lp in zip(*top)]


def _collect(events: Iterator[RequestOutput]) -> dict:
    """The offline API's result: ``text``, ``output_ids`` and ``meta_info`` (SGLang's keys; the
    logprob fields, with ``return_logprob``, as plain logprobs: ``output_token_logprobs``, per
    token ``output_top_logprobs`` ``[[logprob, id], ...]`` with ``top_logprobs``, and from
    ``prompt_logprob_start`` on ``input_token_logprobs`` / ``input_top_logprobs``)."""
    ids: list[int] = []
    lps: list[float] = []
    tops: list = []
    prompt: tuple[list | None, list | None] = (None, None)
    text = []
    last = None
    for out in events:
        ids += out.new_token_ids
        text.append(out.new_text)
        if out.new_logprobs:
            lps += out.new_logprobs
        if out.new_top_logprobs:
            tops += out.new_top_logprobs
        if out.prompt_logprobs is not None:
            prompt = (out.prompt_logprobs, out.prompt_top_logprobs)
        last = out
    if last.error is not None:
        kind = EngineDeadError if last.error.startswith(ENGINE_DEAD) else RequestError
        raise kind(last.error)
    meta = {
        "id": last.rid,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": max(0, last.cached_tokens),
        "cached_tokens_details": cached_details(last),
        "finish_reason": last.finish_reason,
        **spec_meta(last.spec_verify_ct, last.spec_accepted),
    }
    if lps:
        meta["output_token_logprobs"] = lps
    if tops:
        meta["output_top_logprobs"] = [_pairs(t) for t in tops]
    if prompt[0] is not None:
        meta["input_token_logprobs"] = list(prompt[0])
        if prompt[1] is not None:
            meta["input_top_logprobs"] = [_pairs(t) for t in prompt[1]]
    return {"text": "".join(text), "output_ids": ids, "meta_info": meta}
