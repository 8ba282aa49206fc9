"""Tool-call parsers: turn a model's reply into OpenAI `tool_calls` (whole or streamed).

API (the chat route's seam):

- `get_tool_parser(name) -> ToolParser`; names follow SGLang's / vLLM's `--tool-call-parser`
  values: `qwen` (aliases `qwen25`, `hermes`), `qwen3_coder`, `granite4` (alias `granite`),
  `lfm2` (alias `pythonic`), `nemotron`. An unknown name raises `ValueError` listing the names.
- `detect_tool_parser(chat_template) -> str | None`: the parser for a checkpoint's template,
  chosen by the markers it contains (None: the template renders no tool calls we know).
- `parser.parse(text, tools) -> (content, [ToolCall])` for a finished reply. `ToolCall.
  to_openai()` is `{"id": "call_...", "type": "function", "function": {"name", "arguments"}}`
  with `arguments` a JSON string. A malformed block or an unknown function name stays in the
  content verbatim; untyped values (XML text, pythonic literals) are converted to the tool's
  JSON-schema property types.
- `parser.stream(tools)` -> `ToolStream` with `feed(delta_text) -> [Delta]`, `finish() ->
  [Delta]`, `has_tool_calls`; a Delta is `ContentDelta(text)` or `ToolCallDelta(index, id,
  name, arguments)` (`to_openai()` gives one `delta.tool_calls[]` entry: id + name first,
  then the arguments). Any chunking of a reply gives the same content and calls as `parse`.
- `messages_for_template(messages)`: OpenAI history with each assistant tool call's
  `arguments` JSON string decoded to a dict (what XML / pythonic templates iterate over).

Family -> parser (the format its published chat template renders):

- Qwen3-Next (Qwen3 generation): `<tool_call>{json}</tool_call>` -> `qwen` (SGLang's docs
  name `qwen` for Qwen3-Next).
- Qwen3.5 and Qwen3-Coder: `<tool_call><function=NAME><parameter=ARG>..` XML -> `qwen3_coder`.
- Granite-4.0 (granitemoehybrid): `<tool_call>{json}</tool_call>` -> `granite4`.
- LFM2 / LFM2.5: `<|tool_call_start|>[name(arg=...)]<|tool_call_end|>` -> `lfm2`.
- Nemotron-H / Nemotron Nano v2: `<TOOLCALL>[{json}, ...]</TOOLCALL>` -> `nemotron`
  (Nemotron-3 Nano's template uses the Qwen3-Coder XML: `qwen3_coder`).
"""

from __future__ import annotations

import json
from typing import Any

from mambaradix.server.tools.base import (
    ContentDelta,
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
    tool_schemas,
)
from mambaradix.server.tools.formats import (
    Granite4Parser,
    JsonTagParser,
    NemotronParser,
    PythonicParser,
    Qwen3CoderParser,
    coerce,
)

__all__ = [
    "ContentDelta",
    "Delta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStream",
    "TOOL_PARSERS",
    "coerce",
    "detect_tool_parser",
    "get_tool_parser",
    "messages_for_template",
    "tool_schemas",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "qwen": JsonTagParser,
    "qwen25": JsonTagParser,
    "hermes": JsonTagParser,
    "qwen3_coder": Qwen3CoderParser,
    "granite4": Granite4Parser,
    "granite": Granite4Parser,
    "lfm2": PythonicParser,
    "pythonic": PythonicParser,
    "nemotron": NemotronParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """A parser by `--tool-call-parser` name."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        )
    return cls()


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser name whose markers the chat template renders, or None."""
    t = chat_template or ""
    if "<|tool_call_start|>" in t:
        return "lfm2"
    if "<TOOLCALL>" in t:
        return "nemotron"
    if "<tool_call>" in t:
        if "<function=" in t and "<parameter=" in t:
            return "qwen3_coder"
        if "<|start_of_role|>" in t:
            return "granite4"
        return "qwen"
    return None


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of `messages` where assistant `tool_calls[].function.arguments` JSON strings
    are decoded to dicts (as transformers-style templates expect). A string that is not a
    JSON object raises ValueError naming the message (the route answers 400)."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not calls:
            out.append(m)
            continue
        new_calls = []
        for j, c in enumerate(calls):
            fn = dict(c.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise ValueError(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object"
                    )
                fn["arguments"] = args
            new_calls.append({**c, "function": fn})
        out.append({**m, "tool_calls": new_calls})
    return out
