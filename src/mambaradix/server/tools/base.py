"""Shared types for tool-call parsers: ToolCall, stream deltas, the marker-driven parser base.

A parser knows one start marker and one end marker; the text between them (a "block") is
decoded by the subclass into one or more calls. A block that does not decode, or names a
function not in `tools`, is kept verbatim (markers included) as content.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def new_call_id() -> str:
    """An OpenAI-style tool-call id (`call_` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON string (the OpenAI wire shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ContentDelta:
    """Plain reply text, safe to send as `delta.content`."""

    text: str


@dataclass(slots=True)
class ToolCallDelta:
    """One `delta.tool_calls[]` entry: the first for a call has id + name, later ones
    carry argument fragments (concatenate them to get the JSON string)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


Delta = ContentDelta | ToolCallDelta


def tool_schemas(tools: Any) -> dict[str, dict[str, Any]]:
    """Map function name -> its JSON-schema `parameters` from OpenAI `tools` (dicts or
    pydantic models with `model_dump`)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump()
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def dump_args(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


class ToolParser:
    """Base for marker-delimited formats. Subclasses set `start`, `end` and implement
    `decode_block(block, schemas) -> list[(name, args_dict)] | None`."""

    name: str = ""
    start: str = ""
    end: str = ""

    def decode_block(
        self, block: str, schemas: dict[str, dict[str, Any]]
    ) -> list[tuple[str, dict[str, Any]]] | None:
        raise NotImplementedError

    def _calls(self, block: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
        """Decode a block; None (keep as content) if malformed or any name is unknown."""
        try:
            decoded = self.decode_block(block, schemas)
        except Exception as exc:  # a malformed reply must never fail the request
            logger.debug("%s: undecodable tool-call block (%r)", self.name, exc)
            return None
        if not decoded or any(n not in schemas for n, _ in decoded):
            return None
        return [ToolCall(name=n, arguments=dump_args(a)) for n, a in decoded]

    def parse(self, text: str, tools: Any) -> tuple[str, list[ToolCall]]:
        """Split a finished reply into (content text, calls). Content is every character
        not inside a well-formed call block, verbatim (the route may strip it / map "" to
        null)."""
        schemas = tool_schemas(tools)
        content: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                content.append(text[pos:])
                break
            j = text.find(self.end, i + len(self.start))
            if j < 0:  # unterminated: plain text
                content.append(text[pos:])
                break
            content.append(text[pos:i])
            got = self._calls(text[i + len(self.start) : j], schemas)
            if got is None:
                content.append(text[i : j + len(self.end)])
            else:
                calls.extend(got)
            pos = j + len(self.end)
        return "".join(content), calls

    def stream(self, tools: Any) -> ToolStream:
        """A fresh incremental parser for one streamed reply."""
        return ToolStream(self, tool_schemas(tools))


def _held_prefix(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


class ToolStream:
    """Incremental parsing: `feed(delta_text)` and, at the end, `finish()` return deltas.
    Text that may begin a start marker is held back until decided; a call's deltas are
    sent once its end marker arrives (id + name, then the arguments)."""

    def __init__(self, parser: ToolParser, schemas: dict[str, dict[str, Any]]) -> None:
        self._p = parser
        self._schemas = schemas
        self._buf = ""
        self._in_call = False
        self._index = 0

    def feed(self, delta_text: str) -> list[Delta]:
        self._buf += delta_text
        out: list[Delta] = []
        p = self._p
        while True:
            if not self._in_call:
                i = self._buf.find(p.start)
                if i < 0:
                    keep = _held_prefix(self._buf, p.start)
                    self._emit_text(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._emit_text(out, self._buf[:i])
                self._buf = self._buf[i:]
                self._in_call = True
            j = self._buf.find(p.end, len(p.start))
            if j < 0:
                return out
            block = self._buf[len(p.start) : j]
            raw = self._buf[: j + len(p.end)]
            self._buf = self._buf[j + len(p.end) :]
            self._in_call = False
            calls = p._calls(block, self._schemas)
            if calls is None:
                self._emit_text(out, raw)
                continue
            for call in calls:
                out.append(ToolCallDelta(self._index, id=call.id, name=call.name))
                out.append(ToolCallDelta(self._index, arguments=call.arguments))
                self._index += 1

    def finish(self) -> list[Delta]:
        """Flush what is held back (an unterminated call or a partial marker is content)."""
        out: list[Delta] = []
        self._emit_text(out, self._buf)
        self._buf = ""
        self._in_call = False
        return out

    @property
    def has_tool_calls(self) -> bool:
        """True once any call was emitted (the route's finish_reason is then "tool_calls")."""
        return self._index > 0

    @staticmethod
    def _emit_text(out: list[Delta], text: str) -> None:
        if not text:
            return
        if out and isinstance(out[-1], ContentDelta):
            out[-1].text += text
        else:
            out.append(ContentDelta(text))
