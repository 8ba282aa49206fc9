"""A request's structured-output fields -> ``GrammarSpec`` (server/structured.py), without a
server: every field and its errors, each a 400 naming the field it read (the routes' 400s:
test_structured_output.py; the engine's side of a spec: tests/engine/test_grammar.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mambaradix.core import GrammarSpec
from mambaradix.server.protocol import APIError
from mambaradix.server.structured import constraints, grammar_of, schema_spec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _req(**fields):
    return SimpleNamespace(**fields)


def test_every_way_of_sending_a_schema_is_one_spec():
    """response_format, SGLang's json_schema as an object or as JSON text: one cache key."""
    want = GrammarSpec.from_json_schema(SCHEMA)
    assert want.source == json.dumps(SCHEMA, separators=(",", ":"))
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert grammar_of(_req(response_format=rf)) == want
    assert grammar_of(_req(json_schema=SCHEMA)) == want
    assert grammar_of(_req(json_schema=json.dumps(SCHEMA, indent=2))) == want


def test_plain_text_and_the_other_kinds():
    assert grammar_of(_req()) is None
    assert grammar_of(_req(response_format={"type": "text"})) is None
    assert grammar_of(_req(response_format={"type": "json_object"})) == GrammarSpec("json_object")
    assert grammar_of(_req(regex="[a-c]{3}")) == GrammarSpec("regex", "[a-c]{3}")
    assert grammar_of(_req(ebnf='root ::= "a"')) == GrammarSpec("ebnf", 'root ::= "a"')
    # "text" is no constraint: another field beside it is the request's grammar
    assert grammar_of(_req(response_format={"type": "text"}, regex="a+")) == GrammarSpec(
        "regex", "a+"
    )


BAD = [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "bogus"}}, "response_format.type"),
    (
        {"response_format": {"type": "json_object", "json_schema": {}}},
        "response_format.json_schema",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
        "response_format.json_schema.x",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}},
        "response_format.json_schema.strict",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"properties": 5}}}},
        "response_format.json_schema.schema",
    ),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "json_schema"),
    ({"json_schema": {"type": "string", "pattern": "a", "maxLength": 2}}, "json_schema"),
    ({"json_schema": {"type": "nosuchtype"}}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"regex": "x" * ((1 << 20) + 1)}, "regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    ({"response_format": {"type": "bogus"}, "regex": "a"}, "response_format.type"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=lambda x: str(x)[:60])
def test_bad_fields_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as info:
        grammar_of(_req(**fields))
    err = info.value
    assert (err.status, err.param) == (400, param)
    if "only one of" not in err.message:
        assert err.message.startswith(param + ": "), err.message


def test_prefix_names_generate_s_sampling_params():
    with pytest.raises(APIError) as info:
        grammar_of(_req(regex="(("), prefix="sampling_params.")
    assert info.value.param == "sampling_params.regex"
    assert info.value.message.startswith("sampling_params.regex: invalid regex: ")


def test_schema_spec_names_the_caller_s_field():
    assert schema_spec(SCHEMA, "tools.0.function.parameters") == GrammarSpec.from_json_schema(
        SCHEMA
    )
    with pytest.raises(APIError) as info:
        schema_spec({"type": "object", "properties": 5}, "tools.0.function.parameters")
    assert info.value.param == "tools.0.function.parameters"
    assert info.value.message == (
        "tools.0.function.parameters: invalid json_schema: properties must be an object"
    )


def test_constraints_lists_the_fields_set():
    assert constraints(_req()) == []
    assert constraints(_req(response_format={"type": "text"}, ebnf="x")) == [
        "response_format",
        "ebnf",
    ]
    assert constraints(SimpleNamespace(regex=None, json_schema={}, ebnf=None)) == ["json_schema"]


def test_vllm_fields_are_the_same_specs():
    want = GrammarSpec.from_json_schema(SCHEMA)
    assert grammar_of(_req(guided_json=SCHEMA)) == want
    assert grammar_of(_req(guided_json=json.dumps(SCHEMA))) == want
    assert grammar_of(_req(structured_outputs={"json": SCHEMA})) == want
    assert grammar_of(_req(guided_regex="a+")) == GrammarSpec("regex", "a+")
    assert grammar_of(_req(structured_outputs={"regex": "a+"})) == GrammarSpec("regex", "a+")
    ebnf = 'root ::= "a"'
    assert grammar_of(_req(guided_grammar=ebnf)) == GrammarSpec("ebnf", ebnf)
    assert grammar_of(_req(structured_outputs={"grammar": ebnf, "regex": None})) == GrammarSpec(
        "ebnf", ebnf
    )
    assert grammar_of(_req(structured_outputs={"json_object": True})) == GrammarSpec("json_object")
    choice = grammar_of(_req(guided_choice=['a "b"', "c\\d", "é"]))
    assert choice == GrammarSpec("ebnf", 'root ::= "a \\"b\\"" | "c\\\\d" | "é"')
    assert grammar_of(_req(structured_outputs={"choice": ["x"]})) == GrammarSpec(
        "ebnf", 'root ::= "x"'
    )


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
        ({"guided_regex": "a+("}, "guided_regex"),
        ({"guided_json": "{"}, "guided_json"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
        ({"structured_outputs": {"regex": "a+("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"guided_json": SCHEMA, "regex": "a"}, "guided_json"),
    ],
)
def test_vllm_field_errors_name_the_field(fields, param):
    with pytest.raises(APIError) as err:
        grammar_of(_req(**fields))
    assert err.value.param == param
