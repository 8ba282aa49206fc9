"""Tool calling on the chat route: a request's ``tools`` / ``tool_choice`` / history checked
and resolved to what the template, the engine and the reply need (``ToolCalling``).

- The parser: ``--tool-call-parser`` or the one the chat template's markers name
  (``server.tools.detect_tool_parser``); ``tools`` with neither is a 400.
- ``tool_choice``: ``none`` (SGLang's behaviour: the tools are not rendered and the reply is
  not parsed), ``auto`` (default with tools: rendered, the reply parsed), ``required`` and a
  named function (rendered, and the reply forced into one call of the parser's format whose
  arguments follow the function's schema: ``server.tools.constrain``). A forced call together
  with ``response_format`` / ``regex`` / ``json_schema`` / ``ebnf`` is a 400
  (``server.structured.constraints``).
- Bad ``tools`` (a duplicate or malformed name, ``parameters`` that are not an object schema or
  do not compile: ``server.structured.schema_spec``) and history arguments that are not a JSON
  object are 400s naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mambaradix.core import FieldError, GrammarSpec
from mambaradix.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice
from mambaradix.server.structured import constraints, schema_spec
from mambaradix.server.tools.base import ToolParser
from mambaradix.server.tools.constrain import call_grammar
from mambaradix.server.tools.registry import detect_tool_parser, get_tool_parser

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(slots=True)
class ToolCalling:
    """What one chat request does with tools."""

    parser: ToolParser
    tools: list[dict[str, Any]]  # OpenAI tool objects, for the template and the parser
    grammar: GrammarSpec | None  # required / named: the forced call
    parallel: bool  # false: only the first call of a reply is returned


def template_messages(req: ChatCompletionRequest, messages: list[dict]) -> list[dict]:
    """History with assistant calls' ``arguments`` decoded (what templates iterate over)."""
    try:
        return messages_for_template(messages)
    except FieldError as e:
        raise APIError(str(e), param=e.field) from None


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copy of `messages` where assistant `tool_calls[].function.arguments` JSON strings
    are decoded to dicts (as transformers-style templates expect). A string that is not a
    JSON object raises ``FieldError`` naming the message (the route answers 400)."""
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
                    raise FieldError(
                        f"messages.{i}.tool_calls.{j}.function.arguments",
                        f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
                    )
                fn["arguments"] = args
            new_calls.append({**c, "function": fn})
        out.append({**m, "tool_calls": new_calls})
    return out


def resolve_tools(
    req: ChatCompletionRequest, flag: str, template: str | None
) -> ToolCalling | None:
    """The request's tool calling; None when the reply is plain text (no tools, or ``none``)."""
    choice = req.tool_choice
    if not req.tools:
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    schemas = _check_tools(tools)
    force = choice == "required" or isinstance(choice, NamedToolChoice)
    forced = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if forced is not None and forced not in schemas:
        raise APIError(
            f"tool_choice.function.name: {forced!r} is not one of the tools",
            param="tool_choice.function.name",
        )
    if force and constraints(req):
        raise APIError(
            "tool_choice forces a call: it cannot be combined with another output constraint",
            param="tool_choice",
        )
    if choice == "none":
        return None
    name = flag or detect_tool_parser(template)
    if not name:
        raise APIError(
            "tools: this model's chat template renders no tool-call format this server knows; "
            "start it with --tool-call-parser",
            param="tools",
        )
    grammar = call_grammar(name, schemas, forced) if force else None
    return ToolCalling(get_tool_parser(name), tools, grammar, req.parallel_tool_calls is not False)


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> parameters schema; APIError for a bad tool."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool["function"]
        where = f"tools.{i}.function"
        if not _NAME.fullmatch(fn["name"]):
            raise APIError(
                f"{where}.name: must be 1-64 letters, digits, '_', '.' or '-'",
                param=f"{where}.name",
            )
        if fn["name"] in schemas:
            raise APIError(f"{where}.name: {fn['name']!r} is defined twice", param=f"{where}.name")
        params = fn.get("parameters") or {"type": "object"}
        if params.get("type", "object") != "object":
            raise APIError(
                f"{where}.parameters: must be a JSON schema of an object",
                param=f"{where}.parameters",
            )
        schema_spec(params, f"{where}.parameters")  # compiles: a 400 naming it if not
        schemas[fn["name"]] = params
    return schemas
