"""Tool calling on the chat route: the request's side (which tools, which parser, a forced call's
grammar, the history for the template) and the reply's side (the model's text parsed into OpenAI
`tool_calls`, whole or streamed).

Modules, by concern:

- `resolve.py` (request): `resolve_tools(req, flag, template) -> ToolCalling | None` checks
  `tools` / `tool_choice` and picks the parser and a forced call's grammar (400s naming the field);
  `template_messages` / `messages_for_template` put the history in the template's shape.
- `constrain.py` (request): `call_grammar`, one call in a parser's format over the tools'
  parameter schemas (the `GrammarSpec` of `tool_choice` required / named).
- `registry.py`: parsers by `--tool-call-parser` name, and the one a chat template names.
- `base.py` / `formats.py` (reply): the marker-driven parser and streaming base; the formats.

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

from mambaradix.server.tools.base import (
    ContentDelta,
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
    tool_schemas,
)
from mambaradix.server.tools.formats import coerce
from mambaradix.server.tools.registry import TOOL_PARSERS, detect_tool_parser, get_tool_parser
from mambaradix.server.tools.resolve import (
    ToolCalling,
    messages_for_template,
    resolve_tools,
    template_messages,
)

__all__ = [
    "ContentDelta",
    "Delta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolCalling",
    "ToolStream",
    "TOOL_PARSERS",
    "coerce",
    "detect_tool_parser",
    "get_tool_parser",
    "messages_for_template",
    "resolve_tools",
    "template_messages",
    "tool_schemas",
]
