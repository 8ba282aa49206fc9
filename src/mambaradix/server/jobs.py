"""One engine request behind an HTTP request (a choice): accumulates its events, builds choices.

A ``Job`` is created per (prompt, n-copy), submitted by the route, then either collected whole
(``collect``) or forwarded event by event to a stream (``pump``); ``server.serving`` drives
both, and aborts the jobs of a client that went away. ``Choices`` holds what the jobs of one
HTTP request share: the route, the request, the tokenizer and how to report logprobs, echo,
``max_tokens: 0`` and reasoning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from mambaradix.core import SEED_LIMIT, SamplingParams
from mambaradix.engine.detokenizer import DetokState, IncrementalDetokenizer
from mambaradix.server.logprobs import TokenTable, chat_logprobs, completion_logprobs, text_offsets
from mambaradix.server.metrics import RequestTimer
from mambaradix.server.reasoning import ReasoningSplitter
from mambaradix.server.tools import ContentDelta

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Choices:
    chat: bool
    req: Any
    tok: Any
    table: TokenTable
    logprobs: bool = False  # report logprobs of the generated tokens (and echoed prompt)
    discard: bool = False  # max_tokens 0: the one token the engine generates is not reported
    in_reasoning: bool | None = None  # reasoning parser on: whether replies start in reasoning
    stream_reasoning: bool = True
    tools: Any = None  # server.tools.ToolCalling: replies are parsed into tool calls


class Job:
    __slots__ = (
        "index", "rid", "input_ids", "params", "prompt_key", "ch", "handle", "timer",
        "text_parts", "token_ids", "logprobs", "tops", "prompt_lps", "prompt_tops",
        "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "storage_tokens",
        "spec_verify_ct", "spec_accepted", "finished", "finish_matched",
        "error", "pending_ids", "pending_lps", "pending_tops", "echo_text", "echo_pending",
        "splitter", "withheld", "stream_detok", "stream_state", "stream_seen", "tool_stream",
    )  # fmt: skip

    def __init__(
        self,
        index: int,
        input_ids: list[int],
        params: SamplingParams,
        ch: Choices,
        prompt_key: int,
        echo_text: str | None = None,
    ) -> None:
        self.index = index
        self.rid = uuid.uuid4().hex
        self.input_ids = input_ids
        self.params = params
        self.prompt_key = prompt_key
        self.ch = ch
        self.handle: Any = None
        self.timer: RequestTimer | None = None
        self.text_parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[Any] = []
        self.prompt_lps: list[float] | None = None
        self.prompt_tops: list[Any] | None = None
        self.finish_reason: str | None = None
        self.prompt_tokens = len(input_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.storage_tokens = 0  # of cached_tokens, read back from the storage tier
        self.spec_verify_ct = self.spec_accepted = 0  # speculative verify steps, their tokens
        self.finished = False
        self.finish_matched: str | int | None = None  # the stop string or token that ended it
        self.error: BaseException | None = None
        # streamed tokens not sent yet (an event whose text the detokenizer held back)
        self.pending_ids: list[int] = []
        self.pending_lps: list[float] = []
        self.pending_tops: list[Any] = []
        self.echo_text = echo_text
        self.echo_pending = echo_text is not None
        self.splitter = (
            ReasoningSplitter(ch.in_reasoning) if ch.chat and ch.in_reasoning is not None else None
        )
        self.withheld = ""  # reasoning not streamed yet (stream_reasoning false)
        self.stream_detok: IncrementalDetokenizer | None = None
        self.stream_state: DetokState | None = None
        self.stream_seen: list[int] = []
        self.tool_stream: Any = None

    @classmethod
    def make(
        cls,
        index: int,
        input_ids: list[int],
        params: SamplingParams,
        copy_index: int,
        ch: Choices,
        prompt_key: int,
        echo_text: str | None = None,
    ) -> Job:
        """The ``copy_index``-th of n samples of one prompt; seeded copies get distinct seeds."""
        if copy_index and params.seed is not None:
            # wraps within the valid range: seed 2^63 - 1 with n = 2 must not overflow
            params = dataclasses.replace(params, seed=(params.seed + copy_index) % SEED_LIMIT)
        return cls(index, input_ids, params, ch, prompt_key, echo_text)

    # ------------------------------------------------------------------ events

    def add(self, out: Any) -> None:
        if self.timer is not None:
            self.timer.observe(out)
        if out.prompt_logprobs is not None:
            self.prompt_lps = out.prompt_logprobs
            self.prompt_tops = out.prompt_top_logprobs
        if not self.ch.discard:
            self.text_parts.append(out.new_text)
            self.token_ids.extend(out.new_token_ids)
            if out.new_logprobs:
                self.logprobs.extend(out.new_logprobs)
                self.tops.extend(out.new_top_logprobs or [None] * len(out.new_logprobs))
            self.completion_tokens = out.completion_tokens
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = max(0, out.cached_tokens)
        self.storage_tokens = out.storage_tokens
        self.spec_verify_ct, self.spec_accepted = out.spec_verify_ct, out.spec_accepted
        if out.finished:
            self.finished = True
            self.finish_reason = "length" if self.ch.discard else out.finish_reason
            self.finish_matched = out.finish_matched
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

    def _echo_logprobs(self) -> tuple[list[int], list[float | None], list[Any], list[int]]:
        """The echoed prompt's part of completions logprobs."""
        ids = list(self.input_ids)
        lps: list[float | None] = [None, *(self.prompt_lps or [])]
        tops = [None, *(self.prompt_tops or [None] * (len(ids) - 1))]
        offsets = text_offsets(self.ch.tok, ids, self.params.skip_special_tokens)
        return ids, lps[: len(ids)], tops[: len(ids)], offsets

    def _message(self, text: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if self.splitter is not None:
            r1, c1 = self.splitter.feed(text)
            r2, c2 = self.splitter.flush()
            reasoning, content = r1 + r2, c1 + c2
            msg["content"] = content if (content or not reasoning) else None
            msg["reasoning_content"] = reasoning or None
        return msg

    def final_choice(self) -> dict[str, Any]:
        ch, req = self.ch, self.ch.req
        text = "".join(self.text_parts)
        choice: dict[str, Any] = {"index": self.index}
        if ch.chat:
            choice["message"] = self._message(text)
            choice["logprobs"] = (
                chat_logprobs(ch.table, self.token_ids, self.logprobs, self.tops)
                if ch.logprobs
                else None
            )
            if ch.tools is not None:
                choice["finish_reason"] = self._tool_calls(choice["message"])
        else:
            echo = self.echo_text or ""
            choice["text"] = echo + text
            choice["logprobs"] = None
            if ch.logprobs:
                ids: list[int] = []
                lps: list[float | None] = []
                tops: list[Any] = []
                offsets: list[int] = []
                if self.echo_text is not None:
                    ids, lps, tops, offsets = self._echo_logprobs()
                skip = self.params.skip_special_tokens
                offsets += text_offsets(ch.tok, self.token_ids, skip, base=len(echo))
                choice["logprobs"] = completion_logprobs(
                    ch.table, ids + self.token_ids, lps + self.logprobs, tops + self.tops, offsets
                )
        choice.setdefault("finish_reason", self.finish_reason)
        if req.return_token_ids:
            choice["token_ids"] = list(self.token_ids)
            choice["prompt_token_ids"] = self.input_ids
        return choice

    def _tool_calls(self, msg: dict[str, Any]) -> str | None:
        """Move the calls in a finished reply's content to ``tool_calls``; the finish reason."""
        calling = self.ch.tools
        content, calls = calling.parser.parse(msg["content"] or "", calling.tools)
        if not calls:
            return self.finish_reason
        msg["content"] = content if content.strip() else None
        msg["tool_calls"] = [c.to_openai() for c in (calls if calling.parallel else calls[:1])]
        return "tool_calls" if self.finish_reason == "stop" else self.finish_reason

    def _stream_tools(self, content: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """A streamed content piece through the tool-call parser: plain text, call deltas."""
        calling = self.ch.tools
        if self.tool_stream is None:
            self.tool_stream = calling.parser.stream(calling.tools)
        deltas = self.tool_stream.feed(content) if content else []
        if finished:
            deltas += self.tool_stream.finish()
        text = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        calls = [
            d.to_openai()
            for d in deltas
            if not isinstance(d, ContentDelta) and (calling.parallel or d.index == 0)
        ]
        return text, calls

    def _stream_offsets(self, ids: list[int]) -> list[int]:
        if self.stream_detok is None:
            self.stream_detok = IncrementalDetokenizer(self.ch.tok, self.params.skip_special_tokens)
            self.stream_state = DetokState()
        base = len(self.echo_text or "")
        out = []
        for t in ids:
            out.append(base + len(self.stream_state.text))
            self.stream_seen.append(t)
            self.stream_detok.step(self.stream_state, self.stream_seen)
        return out

    def chunk_choice(self, out: Any) -> dict[str, Any] | None:
        """The streamed choice for one event, or None when the event carries no text yet (its
        token ids and logprobs are then sent with the next chunk)."""
        ch, req = self.ch, self.ch.req
        new_text = out.new_text
        if not ch.discard:
            self.pending_ids.extend(out.new_token_ids)
            if out.new_logprobs:
                self.pending_lps.extend(out.new_logprobs)
                self.pending_tops.extend(out.new_top_logprobs or [None] * len(out.new_logprobs))
        else:
            new_text = ""
        echo_now = self.echo_pending and (not ch.logprobs or self.prompt_lps is not None)
        if not (new_text or out.finished or echo_now):
            return None
        ids, self.pending_ids = self.pending_ids, []
        lps, self.pending_lps = self.pending_lps, []
        tops, self.pending_tops = self.pending_tops, []
        choice: dict[str, Any] = {"index": self.index}
        if ch.chat:
            choice["delta"] = self._delta(new_text, out.finished)
            choice["logprobs"] = chat_logprobs(ch.table, ids, lps, tops) if ch.logprobs else None
        else:
            text, all_ids, all_lps, all_tops, offsets = new_text, ids, list(lps), tops, []
            if echo_now:
                self.echo_pending = False
                text = (self.echo_text or "") + new_text
                if ch.logprobs:
                    e_ids, e_lps, e_tops, offsets = self._echo_logprobs()
                    all_ids, all_lps, all_tops = e_ids + ids, e_lps + all_lps, e_tops + tops
            choice["text"] = text
            choice["logprobs"] = None
            if ch.logprobs:
                offsets += self._stream_offsets(ids)
                choice["logprobs"] = completion_logprobs(
                    ch.table, all_ids, all_lps, all_tops, offsets
                )
        reason = self.finish_reason if out.finished else None
        if reason == "stop" and self.tool_stream is not None and self.tool_stream.has_tool_calls:
            reason = "tool_calls"
        choice["finish_reason"] = reason
        if req.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def _delta(self, text: str, finished: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        content = text
        if self.splitter is not None:
            reasoning, content = self.splitter.feed(text)
            if finished:
                r, c = self.splitter.flush()
                reasoning, content = reasoning + r, content + c
            if not self.ch.stream_reasoning:  # reasoning goes out in one piece when it ends
                self.withheld += reasoning
                reasoning = ""
                if self.withheld and (content or finished or self.splitter.mode != "reasoning"):
                    reasoning, self.withheld = self.withheld, ""
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.ch.tools is not None:
            content, calls = self._stream_tools(content, finished)
            if calls:
                delta["tool_calls"] = calls
        if content:
            delta["content"] = content
        return delta
