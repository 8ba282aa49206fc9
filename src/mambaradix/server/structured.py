"""A request's structured-output fields -> the engine's ``GrammarSpec``, or a 400 naming the field.

The one place the server reads them; the engine takes only a ``GrammarSpec``. At most one per
request:

- OpenAI ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (``strict`` true or false: the schema is enforced either way);
- SGLang's ``regex``, ``json_schema`` (a schema, as a JSON string or an object) and ``ebnf``: on
  ``/generate``'s ``sampling_params`` and as extra body fields of the OpenAI routes;
- vLLM's extra body fields of the OpenAI routes: ``guided_json`` / ``guided_regex`` /
  ``guided_grammar`` (as the three above), ``guided_choice`` (the output is one of a list of
  strings), and ``structured_outputs`` holding one of ``json`` / ``regex`` / ``choice`` /
  ``grammar`` / ``json_object: true``;
- on the chat route, ``tool_choice`` required / named: one forced call, whose grammar
  ``resolve_tools`` builds (``server.tools.resolve``: each tool's parameters through
  ``schema_spec``); it refuses a forced call together with any field above (``constraints``).

Every schema, regex and grammar is built once here (``engine.grammar.validate_spec``: no
tokenizer, cheap), so a bad one is a 400 before the request reaches the engine; the engine
compiles it against the vocabulary. Each check knows the field it reads: errors name it
directly (with the caller's ``prefix``, ``sampling_params.`` on ``/generate``).
"""

from __future__ import annotations

import json
from typing import Any

from mambaradix.core import GrammarSpec
from mambaradix.engine.grammar import validate_spec
from mambaradix.server.protocol import APIError

# in the order errors name them
FIELDS = ("response_format", "regex", "json_schema", "ebnf", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "structured_outputs")  # fmt: skip
# vLLM's fields as the spec kind they stand for (``guided_choice``: an EBNF of the choices)
_VLLM = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "ebnf"}
# vLLM's structured_outputs object: its keys as the fields above
_STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                       "grammar": "guided_grammar", "json_object": None}  # fmt: skip
MAX_SOURCE_CHARS = 1 << 20  # a schema / regex / grammar longer than 1 MiB is refused
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def constraints(req: Any) -> list[str]:
    """The output-constraint fields ``req`` sets: an OpenAI request, or one of ``/generate``'s
    ``sampling_params`` (which has no ``response_format``)."""
    return [name for name in FIELDS if getattr(req, name, None) is not None]


def grammar_of(req: Any, prefix: str = "") -> GrammarSpec | None:
    """The grammar ``req``'s fields ask for (None: plain text); an ``APIError`` naming the field
    (after ``prefix``) for a bad value or more than one constraint."""
    given = constraints(req)
    rf = getattr(req, "response_format", None)
    if rf is not None:
        _check_response_format(rf, prefix)
        kind = rf.get("type")
        if kind not in _RESPONSE_FORMAT_TYPES:
            raise _error(
                prefix + "response_format.type",
                f"{kind!r} is not one of 'text', 'json_object', 'json_schema'",
            )
        if kind == "text":
            given.remove("response_format")
    if len(given) > 1:
        raise APIError(
            f"{prefix}only one of {', '.join(given)} may be set: a request takes one output "
            "constraint",
            param=prefix + given[-1],
        )
    if not given:
        return None
    field = given[0]
    value = getattr(req, field)
    if field == "response_format":
        return _response_format_spec(value, prefix + field)
    if field == "structured_outputs":
        key, value = _structured_outputs(value, prefix + field)
        where = f"{prefix}{field}.{key}"
        if key == "json_object":
            return GrammarSpec("json_object")
        field = _STRUCTURED_OUTPUTS[key]
    else:
        where = prefix + field
    if field == "guided_choice":
        return _choice_spec(value, where)
    kind = _VLLM.get(field, field)
    if kind == "json_schema":
        return schema_spec(value, where)
    if not isinstance(value, str) or not value:
        raise _error(where, "must be a non-empty string")
    if len(value) > MAX_SOURCE_CHARS:
        raise _error(where, f"longer than {MAX_SOURCE_CHARS} characters")
    return _validated(GrammarSpec(kind, value), where)


def _structured_outputs(value: Any, where: str) -> tuple[str, Any]:
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``,
    ``grammar`` or ``json_object: true``, as ``(that key, its value)``."""
    if not isinstance(value, dict):
        raise _error(where, "must be an object")
    unknown = sorted(k for k in value if k not in _STRUCTURED_OUTPUTS)
    if unknown:
        raise _error(f"{where}.{unknown[0]}", "not supported by this server")
    given = [k for k in _STRUCTURED_OUTPUTS if value.get(k) not in (None, False)]
    if len(given) != 1:
        names = ", ".join(_STRUCTURED_OUTPUTS)
        raise _error(where, f"needs exactly one of {names}, got {len(given)}")
    key = given[0]
    if key == "json_object" and value[key] is not True:
        raise _error(f"{where}.json_object", "must be true")
    return key, value[key]


def _choice_spec(choices: Any, where: str) -> GrammarSpec:
    """vLLM's ``guided_choice``: the output is exactly one of the strings."""
    if not isinstance(choices, list) or not choices:
        raise _error(where, "must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise _error(where, "every choice must be a non-empty string")
    source = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    if len(source) > MAX_SOURCE_CHARS:
        raise _error(where, f"longer than {MAX_SOURCE_CHARS} characters")
    return _validated(GrammarSpec("ebnf", source), where)


def schema_spec(schema: Any, where: str) -> GrammarSpec:
    """A JSON schema (an object, or its JSON text) as a checked ``json_schema`` spec; an
    ``APIError`` naming ``where`` when it is not one or its grammar cannot be built."""
    if isinstance(schema, str):
        if len(schema) > MAX_SOURCE_CHARS:
            raise _error(where, f"schema longer than {MAX_SOURCE_CHARS} characters")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _error(where, f"not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise _error(where, f"a JSON schema must be an object, got {type(schema).__name__}")
    spec = GrammarSpec.from_json_schema(schema)
    if len(spec.source) > MAX_SOURCE_CHARS:
        raise _error(where, f"schema longer than {MAX_SOURCE_CHARS} characters")
    return _validated(spec, where)


def _response_format_spec(rf: dict[str, Any], where: str) -> GrammarSpec:
    """``json_object`` or ``json_schema`` (``_check_response_format`` has checked the shape)."""
    if rf["type"] == "json_object":
        return GrammarSpec("json_object")
    body = rf.get("json_schema")
    if not isinstance(body, dict):
        raise _error(where + ".json_schema", "must be an object with a 'schema'")
    schema = body.get("schema")
    if schema is None:
        raise _error(where + ".json_schema.schema", "missing")
    return schema_spec(schema, where + ".json_schema.schema")


def _validated(spec: GrammarSpec, where: str) -> GrammarSpec:
    try:
        validate_spec(spec, where)  # its message starts with ``where``
    except ValueError as e:
        raise APIError(str(e), param=where) from None
    return spec


def _error(where: str, why: str) -> APIError:
    return APIError(f"{where}: {why}", param=where)


def _check_response_format(rf: Any, prefix: str) -> None:
    """OpenAI's shape: an object, no keys the server would ignore, right types."""
    where = prefix + "response_format"
    if not isinstance(rf, dict):
        raise _error(where, "must be an object")
    allowed = {"type", "json_schema"} if rf.get("type") == "json_schema" else {"type"}
    extra = sorted(set(rf) - allowed)
    if extra:
        raise _error(f"{where}.{extra[0]}", "unknown field")
    body = rf.get("json_schema")
    if isinstance(body, dict):
        extra = sorted(set(body) - _JSON_SCHEMA_KEYS)
        if extra:
            raise _error(f"{where}.json_schema.{extra[0]}", "unknown field")
        for key, kind in (("name", str), ("description", str), ("strict", bool)):
            value = body.get(key)
            if value is not None and not isinstance(value, kind):
                raise _error(f"{where}.json_schema.{key}", f"must be a {kind.__name__}")
