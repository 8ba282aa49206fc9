"""One engine request behind an HTTP request (a choice): accumulates its events, builds choices.

A ``Job`` is created per (prompt, n-copy), submitted by the app, then either collected whole
(``collect``) or forwarded event by event to a stream (``pump``). ``watch_disconnect`` aborts
the jobs of a non-streaming request whose client went away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any

from mambaradix.core import SEED_LIMIT, SamplingParams
from mambaradix.server.metrics import RequestTimer
from mambaradix.server.protocol import APIError, chat_logprobs, completion_logprobs

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2


class Job:
    __slots__ = (
        "index", "rid", "input_ids", "params", "prompt_key", "tok", "handle", "timer",
        "text_parts", "token_ids", "logprobs", "finish_reason", "prompt_tokens",
        "completion_tokens", "cached_tokens", "finished", "error", "pending_ids", "pending_lps",
    )  # fmt: skip

    def __init__(
        self, index: int, input_ids: list[int], params: SamplingParams, tok: Any, prompt_key: int
    ) -> None:
        self.index = index
        self.rid = uuid.uuid4().hex
        self.input_ids = input_ids
        self.params = params
        self.prompt_key = prompt_key
        self.tok = tok
        self.handle: Any = None
        self.timer: RequestTimer | None = None
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = len(input_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False
        self.error: BaseException | None = None
        # streamed tokens not sent yet (an event whose text the detokenizer held back)
        self.pending_ids: list[int] = []
        self.pending_lps: list[float] = []

    @classmethod
    def make(
        cls,
        index: int,
        input_ids: list[int],
        params: SamplingParams,
        copy_index: int,
        tok: Any,
        prompt_key: int,
    ) -> Job:
        """The ``copy_index``-th of n samples of one prompt; seeded copies get distinct seeds."""
        if copy_index and params.seed is not None:
            # wraps within the valid range: seed 2^63 - 1 with n = 2 must not overflow
            params = dataclasses.replace(params, seed=(params.seed + copy_index) % SEED_LIMIT)
        return cls(index, input_ids, params, tok, prompt_key)

    # ------------------------------------------------------------------ events

    def add(self, out: Any) -> None:
        if self.timer is not None:
            self.timer.observe(out)
        self.text_parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = max(0, out.cached_tokens)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            if out.error is not None:
                self.error = RuntimeError(out.error)

    async def collect(self) -> None:
        try:
            async for out in self.handle.aevents():
                self.add(out)
        except Exception as e:  # engine fault: reported to the client as a 500
            logger.exception("request %s failed in the engine", self.rid)
            self.error = e

    async def pump(self, queue: asyncio.Queue) -> None:
        try:
            async for out in self.handle.aevents():
                await queue.put((self, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("request %s failed in the engine", self.rid)
            await queue.put((self, e))

    # ------------------------------------------------------------------ choices

    def _token_strs(self, ids: list[int]) -> list[str]:
        return [self.tok.decode([t]) for t in ids]

    def final_choice(self, chat: bool, req: Any) -> dict[str, Any]:
        text = "".join(self.text_parts)
        lps = self.logprobs if self.params.return_logprob else None
        choice: dict[str, Any] = {"index": self.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = (
                chat_logprobs(self._token_strs(self.token_ids), lps) if lps is not None else None
            )
        else:
            choice["text"] = text
            choice["logprobs"] = (
                completion_logprobs(self._token_strs(self.token_ids), lps)
                if lps is not None
                else None
            )
        choice["finish_reason"] = self.finish_reason
        if req.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
            choice["prompt_token_ids"] = self.input_ids
        return choice

    def chunk_choice(self, out: Any, chat: bool, req: Any) -> dict[str, Any] | None:
        """The streamed choice for one event, or None when the event carries no text yet (its
        token ids and logprobs are then sent with the next chunk)."""
        self.pending_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.pending_lps.extend(out.new_logprobs)
        if not (out.new_text or out.finished):
            return None
        ids, self.pending_ids = self.pending_ids, []
        lps, self.pending_lps = self.pending_lps, []
        want_lps = self.params.return_logprob and lps
        strs = self._token_strs(ids) if want_lps else []
        choice: dict[str, Any] = {"index": self.index}
        if chat:
            choice["delta"] = {"content": out.new_text} if out.new_text else {}
            choice["logprobs"] = chat_logprobs(strs, lps) if want_lps else None
        else:
            choice["text"] = out.new_text
            choice["logprobs"] = completion_logprobs(strs, lps) if want_lps else None
        choice["finish_reason"] = out.finish_reason if out.finished else None
        if req.return_token_ids:
            choice["token_ids"] = ids
        return choice


def first_error(jobs: list[Job]) -> APIError | None:
    for job in jobs:
        if job.error is not None:
            return APIError(f"engine error: {job.error}", 500, "server_error")
    return None


def abort_unfinished(engine: Any, jobs: list[Job]) -> None:
    """Abort in the engine what the client no longer waits for, and count it as aborted (the
    engine's final event for it reaches nobody)."""
    for job in jobs:
        if not job.finished:
            engine.abort(job.rid)
            if job.timer is not None:
                job.timer.aborted()


async def watch_disconnect(request: Any, engine: Any, jobs: list[Job]) -> None:
    """Poll the connection of a non-streaming request; abort its jobs when the client is gone."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if await request.is_disconnected():
            logger.info("client disconnected; aborting %d request(s)", len(jobs))
            for job in jobs:
                if not job.finished:
                    engine.abort(job.rid)
            return
