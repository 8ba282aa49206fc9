"""The concrete tool-call formats (markers and block grammars) and JSON-schema coercion."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from mambaradix.server.tools.base import ToolParser

Decoded = list[tuple[str, dict[str, Any]]]


def _json_call(obj: Any) -> tuple[str, dict[str, Any]]:
    """{"name": str, "arguments" | "parameters": object} -> (name, args)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a {name, arguments} object")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments JSON as a string
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments is not an object")
    return obj["name"], args


def _types(schema: dict[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    return []


def coerce(value: Any, schema: dict[str, Any] | None) -> Any:
    """Convert an untyped value (XML text, a pythonic literal) to the schema's type where it
    converts cleanly; otherwise return it unchanged (the client sees what the model wrote)."""
    types = _types(schema or {})
    if not isinstance(value, str):
        if "string" in types and not ({"number", "integer"} & set(types)):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
        return value
    s = value
    for t in types or ["__any__"]:
        if t == "string":
            return s
        if t == "integer" and re.fullmatch(r"[+-]?\d+", s.strip()):
            return int(s.strip())
        if t == "number":
            try:
                f = float(s.strip())
            except ValueError:
                continue
            return int(f) if re.fullmatch(r"[+-]?\d+", s.strip()) else f
        if t == "boolean" and s.strip().lower() in ("true", "false"):
            return s.strip().lower() == "true"
        if t == "null" and s.strip().lower() in ("null", "none"):
            return None
        if t in ("object", "array", "__any__"):
            try:
                return json.loads(s)
            except ValueError:
                try:
                    return ast.literal_eval(s)
                except (ValueError, SyntaxError):
                    continue
    return s


def _props(schemas: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    props = schemas.get(name, {}).get("properties")
    return props if isinstance(props, dict) else {}


class JsonTagParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes / Qwen2.5 /
    Qwen3 / Qwen3-Next / Granite-4.0). Arguments are already typed JSON."""

    name = "qwen"
    start = "<tool_call>"
    end = "</tool_call>"

    def decode_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> Decoded:
        return [_json_call(json.loads(block))]


class Granite4Parser(JsonTagParser):
    """Granite-4.0: the same `<tool_call>` JSON blocks as Hermes."""

    name = "granite4"


class NemotronParser(ToolParser):
    """Nemotron-H / Nemotron Nano v2: `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]
    </TOOLCALL>`, one block holding a JSON list of calls."""

    name = "nemotron"
    start = "<TOOLCALL>"
    end = "</TOOLCALL>"

    def decode_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> Decoded:
        obj = json.loads(block)
        items = obj if isinstance(obj, list) else [obj]
        return [_json_call(x) for x in items]


_FUNC_RE = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder / Qwen3.5 XML: `<tool_call><function=NAME><parameter=ARG>value
    </parameter>...</function></tool_call>`; values are text, converted by the schema."""

    name = "qwen3_coder"
    start = "<tool_call>"
    end = "</tool_call>"

    def decode_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> Decoded:
        funcs = list(_FUNC_RE.finditer(block))
        if not funcs or _FUNC_RE.sub("", block).strip():
            raise ValueError("block is not <function=...> elements")
        out: Decoded = []
        for f in funcs:
            name = f.group(1).strip()
            props = _props(schemas, name)
            body = f.group(2)
            if _PARAM_RE.sub("", body).strip():
                raise ValueError("stray text between parameters")
            args: dict[str, Any] = {}
            for p in _PARAM_RE.finditer(body):
                key = p.group(1).strip()
                raw = p.group(2)
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                args[key] = coerce(raw, props.get(key) if key in props else None)
            out.append((name, args))
        return out


_NAMED_CONSTS = {"true": True, "false": False, "null": None, "none": None}


def _literal(node: ast.AST) -> Any:
    """A Python literal, also accepting JSON's true / false / null."""
    if isinstance(node, ast.Name) and node.id.lower() in _NAMED_CONSTS:
        return _NAMED_CONSTS[node.id.lower()]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _literal(node.operand)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError("sign on a non-number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes):
        return node.value
    raise ValueError(f"not a literal: {type(node).__name__}")


class PythonicParser(ToolParser):
    """LFM2: `<|tool_call_start|>[name(arg=1, other="x"), ...]<|tool_call_end|>`, keyword
    arguments with literal values (a JSON list of {name, arguments} is accepted too)."""

    name = "lfm2"
    start = "<|tool_call_start|>"
    end = "<|tool_call_end|>"

    def decode_block(self, block: str, schemas: dict[str, dict[str, Any]]) -> Decoded:
        text = block.strip()
        if text.startswith("[{") or text.startswith("{"):
            obj = json.loads(text)
            return [_json_call(x) for x in (obj if isinstance(obj, list) else [obj])]
        tree = ast.parse(text, mode="eval").body
        calls = tree.elts if isinstance(tree, ast.List) else [tree]
        out: Decoded = []
        for c in calls:
            if not isinstance(c, ast.Call) or not isinstance(c.func, ast.Name) or c.args:
                raise ValueError("expected name(key=value, ...)")
            props = _props(schemas, c.func.id)
            args: dict[str, Any] = {}
            for kw in c.keywords:
                if kw.arg is None:
                    raise ValueError("**kwargs")
                args[kw.arg] = coerce(_literal(kw.value), props.get(kw.arg))
            out.append((c.func.id, args))
        return out
