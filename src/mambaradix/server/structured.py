"""Structured-output request fields -> the engine's ``GrammarSpec`` (or a 400 naming the field).

Accepted, at most one per request:

- OpenAI ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (``strict`` true or false: the schema is enforced either way);
- SGLang's ``regex``, ``json_schema`` (a schema, as a JSON string or an object) and ``ebnf``: on
  ``/generate``'s ``sampling_params`` and as extra body fields of the OpenAI routes.

Every schema, regex and grammar is built once here (no tokenizer: cheap), so a bad one is a 400
before the request reaches the engine; the engine compiles it against the vocabulary.
"""

from __future__ import annotations

from typing import Any

from mambaradix.core import GrammarSpec
from mambaradix.engine.grammar import spec_from_request
from mambaradix.server.protocol import APIError

_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def grammar_of(
    *,
    response_format: Any = None,
    regex: Any = None,
    json_schema: Any = None,
    ebnf: Any = None,
    prefix: str = "",
) -> GrammarSpec | None:
    """The grammar the fields ask for (None: plain text). ``prefix`` is put before the field
    names of errors (``sampling_params.``)."""
    given = [
        n
        for n, v in (
            ("response_format", response_format),
            ("regex", regex),
            ("json_schema", json_schema),
            ("ebnf", ebnf),
        )
        if v is not None
    ]
    if response_format is not None:
        _check_response_format(response_format, prefix)
    try:
        return spec_from_request(
            response_format=response_format, regex=regex, json_schema=json_schema, ebnf=ebnf
        )
    except ValueError as e:
        msg = str(e)
        if msg.startswith("only one of"):
            param = given[-1]
            raise APIError(
                f"{prefix}{msg}: a request takes one output constraint", param=prefix + param
            ) from None
        field = msg.split(":", 1)[0]
        param = field if field.replace(".", "").replace("_", "").isalnum() else given[0]
        raise APIError(prefix + msg, param=prefix + param) from None


def _check_response_format(rf: Any, prefix: str) -> None:
    """OpenAI's shape: no keys the server would ignore, right types."""
    where = prefix + "response_format"
    if not isinstance(rf, dict):
        raise APIError(f"{where}: must be an object", param=where)
    allowed = {"type", "json_schema"} if rf.get("type") == "json_schema" else {"type"}
    extra = sorted(set(rf) - allowed)
    if extra:
        raise APIError(f"{where}.{extra[0]}: unknown field", param=f"{where}.{extra[0]}")
    body = rf.get("json_schema")
    if isinstance(body, dict):
        extra = sorted(set(body) - _JSON_SCHEMA_KEYS)
        if extra:
            raise APIError(
                f"{where}.json_schema.{extra[0]}: unknown field",
                param=f"{where}.json_schema.{extra[0]}",
            )
        for key, kind in (("name", str), ("description", str), ("strict", bool)):
            value = body.get(key)
            if value is not None and not isinstance(value, kind):
                raise APIError(
                    f"{where}.json_schema.{key}: must be a {kind.__name__}",
                    param=f"{where}.json_schema.{key}",
                )
