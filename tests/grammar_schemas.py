"""Twenty bounded JSON schemas (string lengths and array sizes capped, compact output) shared
by the grammar tests of the engine (tests/engine/test_grammar.py) and the server
(tests/server/test_structured_output.py): nested objects, enums, arrays, anyOf, $ref, const."""

from __future__ import annotations

S = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"a": S}, "required": ["a"], "additionalProperties": False},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "boolean"},
    {"type": "null"},
    {"enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 10, "maximum": 20},
            "b": {"type": "boolean"},
        },
        "required": ["n", "b"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "outer": {
                "type": "object",
                "properties": {"inner": S, "z": {"type": "null"}},
                "required": ["inner", "z"],
                "additionalProperties": False,
            }
        },
        "required": ["outer"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"mode": {"enum": ["fast", "slow"]}, "level": {"enum": [1, 2, 3]}},
        "required": ["mode", "level"],
        "additionalProperties": False,
    },
    {"type": "string", "minLength": 2, "maxLength": 4},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["id"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
    {
        "type": "object",
        "properties": {"opt": S, "req": {"type": "boolean"}},
        "required": ["req"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]},
    {"type": ["string", "null"], "maxLength": 3},
    {
        "type": "object",
        "properties": {
            "x": {"const": "fixed"},
            "y": {"type": "integer", "minimum": -100, "maximum": -1},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {
                            "c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
                        },
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["x", "y", None]}, "minItems": 2, "maxItems": 2},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": ["string", "null"], "maxLength": 10},
            "active": {"type": "boolean"},
            "roles": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2},
        },
        "required": ["name", "age", "active", "roles"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/pt"}, "q": {"$ref": "#/$defs/pt"}},
        "required": ["p", "q"],
        "additionalProperties": False,
    },
]
