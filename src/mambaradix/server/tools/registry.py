"""Tool-call parsers by ``--tool-call-parser`` name, and the one a chat template's markers name."""

from __future__ import annotations

from mambaradix.server.tools.base import ToolParser
from mambaradix.server.tools.formats import (
    Granite4Parser,
    JsonTagParser,
    NemotronParser,
    PythonicParser,
    Qwen3CoderParser,
)

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
