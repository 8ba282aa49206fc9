"""``tool_choice`` required / named as a grammar: one call in the parser's own format, its
arguments constrained by the tool's JSON schema (constrained decoding, ``engine.grammar``).

The call text is what the family's template renders for an assistant tool call (JSON with
``", "`` / ``": "`` separators, as the templates' ``tojson`` writes it), so a forced call comes
back in the next turn's prompt unchanged and the prefix cache keeps the hit. Per format:

- ``qwen`` / ``hermes``: ``<tool_call>{"name": "f", "arguments": ARGS}</tool_call>``; ``granite4``
  the same with the JSON on its own line
- ``nemotron``: ``<TOOLCALL>[{"name": "f", "arguments": ARGS}]</TOOLCALL>``
- ``qwen3_coder``: ``<tool_call>\\n<function=f>\\n<parameter=k>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>`` (a string VALUE is raw text without ``<`` or a newline, other
  types their JSON)
- ``lfm2``: ``<|tool_call_start|>[f(k=VALUE, ...)]<|tool_call_end|>`` (VALUE: JSON literals)

The grammar goes to the engine as EBNF text (``GrammarSpec("ebnf", ...)``).
"""

from __future__ import annotations

import json
from typing import Any

from mambaradix.core import GrammarSpec
from mambaradix.engine.grammar import json_schema_grammar, xgr  # xgrammar, imported lazily

_SEPARATORS = (", ", ": ")  # json.dumps' defaults: what the templates' tojson renders
_JSON_TAGS = {
    "qwen": ("<tool_call>", "</tool_call>"),
    "qwen25": ("<tool_call>", "</tool_call>"),
    "hermes": ("<tool_call>", "</tool_call>"),
    "granite4": ("<tool_call>\n", "\n</tool_call>"),  # Granite 4 puts the JSON on its own line
    "granite": ("<tool_call>\n", "\n</tool_call>"),
    "nemotron": ("<TOOLCALL>[", "]</TOOLCALL>"),
}
_ANY_OBJECT = {"type": "object"}


def _lit(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _json(schema: Any) -> xgr.Grammar:
    return json_schema_grammar(json.dumps(schema, ensure_ascii=False), False, _SEPARATORS)


def _xml_value(schema: dict[str, Any]) -> xgr.Grammar:
    """A ``<parameter>`` body: raw text for strings, JSON otherwise."""
    if schema.get("type") == "string" and "enum" not in schema:
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        rep = f"{{{lo},{int(hi)}}}" if hi is not None else ("+" if lo else "*")
        return xgr.Grammar.from_regex(f"[^<\\x00-\\x1f]{rep}")
    if schema.get("type") == "string":
        return xgr.Grammar.union(*[_lit(str(v)) for v in schema["enum"]])
    return _json(schema)


def _properties(params: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    props = params.get("properties")
    if not isinstance(props, dict):
        return []
    return [(k, v if isinstance(v, dict) else {}) for k, v in props.items()]


def _one_call(parser: str, name: str, params: dict[str, Any]) -> xgr.Grammar:
    if parser in _JSON_TAGS:
        start, end = _JSON_TAGS[parser]
        head = f'{start}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        return xgr.Grammar.concat(_lit(head), _json(params or _ANY_OBJECT), _lit("}" + end))
    parts: list[xgr.Grammar] = []
    if parser == "qwen3_coder":
        parts.append(_lit(f"<tool_call>\n<function={name}>\n"))
        for key, schema in _properties(params):
            parts += [_lit(f"<parameter={key}>\n"), _xml_value(schema), _lit("\n</parameter>\n")]
        parts.append(_lit("</function>\n</tool_call>"))
    elif parser in ("lfm2", "pythonic"):
        parts.append(_lit(f"<|tool_call_start|>[{name}("))
        for i, (key, schema) in enumerate(_properties(params)):
            parts += [_lit(f"{', ' if i else ''}{key}="), _json(schema)]
        parts.append(_lit(")]<|tool_call_end|>"))
    else:
        raise ValueError(f"no call grammar for tool-call parser {parser!r}")
    return xgr.Grammar.concat(*parts)


def call_grammar(parser: str, tools: dict[str, dict[str, Any]], name: str | None) -> GrammarSpec:
    """The grammar of one call of ``name`` (or of any of ``tools`` when None), as EBNF.
    ``tools``: function name -> its parameters schema."""
    names = [name] if name is not None else list(tools)
    calls = [_one_call(parser, n, tools[n]) for n in names]
    grammar = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    return GrammarSpec("ebnf", str(grammar))
