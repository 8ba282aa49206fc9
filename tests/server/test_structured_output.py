"""Structured output through the HTTP routes with the ``openai`` client (tiny random-weight
Qwen3-Next): 20 bounded schemas valid under ``jsonschema`` (``finish_reason: "length"`` is a
failure), json_object, SGLang's regex / EBNF / json_schema on both OpenAI routes and on
/generate, streamed == non-streamed, bad grammars 400 naming the field while the engine keeps
serving, and the negative control: the same requests with the mask disabled are invalid."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grammar_schemas import SCHEMAS  # noqa: E402

MAX_TOKENS = 400  # above the longest compact output of any of the schemas


def _schema_format(schema: dict, i: int) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": f"s{i}", "schema": schema, "strict": True},
    }


def _ask_schema(
    client, i: int, stream: bool = False, max_tokens: int = MAX_TOKENS
) -> tuple[str, str]:
    """(text, finish_reason) of a chat request for SCHEMAS[i], seeded sampling."""
    kw = dict(
        model="tiny-qwen",
        messages=[{"role": "user", "content": f"Reply with JSON number {i}."}],
        max_tokens=max_tokens,
        temperature=0.9,
        seed=1000 + i,
        response_format=_schema_format(SCHEMAS[i], i),
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def _valid(i: int, text: str, reason: str) -> bool:
    if reason != "stop":  # "length" means the bound was not kept
        return False
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _all_schemas(client, stream: bool = False, max_tokens: int = MAX_TOKENS) -> list:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # together: one batch of grammar rows
        return list(
            pool.map(lambda i: _ask_schema(client, i, stream, max_tokens), range(len(SCHEMAS)))
        )


def test_twenty_schemas_valid_and_streamed_equals_non_streamed(client, wait_idle):
    assert len(SCHEMAS) == 20
    whole = _all_schemas(client)
    bad = [(i, t, r) for i, (t, r) in enumerate(whole) if not _valid(i, t, r)]
    assert not bad, bad
    streamed = _all_schemas(client, stream=True)
    assert streamed == whole
    wait_idle()


def test_negative_control_without_the_mask_the_outputs_are_invalid(client, engine, monkeypatch):
    monkeypatch.setattr(engine.structured, "start", lambda batch: None)
    # the same requests with fewer tokens (unmasked, most would run to any limit)
    outs = _all_schemas(client, max_tokens=60)
    invalid = sum(not _valid(i, t, r) for i, (t, r) in enumerate(outs))
    assert invalid >= 15, outs


def test_json_object(client):
    r = client.chat.completions.create(
        model="tiny-qwen",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


EBNF = 'root ::= "answer: " ("yes" | "no") " (" [0-9] [0-9]? ")"'


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_regex_and_ebnf_on_completions(client, stream):
    cases = [({"regex": r"[a-c]{3}-[0-9]{2}"}, r"[a-c]{3}-[0-9]{2}"),
             ({"ebnf": EBNF}, r"answer: (yes|no) \([0-9]{1,2}\)")]  # fmt: skip
    for extra, pattern in cases:
        kw = dict(model="tiny-qwen", prompt="go", max_tokens=50, temperature=0, extra_body=extra)
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.completions.create(**kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert re.fullmatch(pattern, text) and reason == "stop", (extra, text)


def test_sglang_fields_on_chat_and_generate(client, http):
    schema = SCHEMAS[6]
    r = client.chat.completions.create(
        model="tiny-qwen",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"json_schema": json.dumps(schema)},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    for sp, pattern in (({"regex": "[xyz]{4}"}, "[xyz]{4}"), ({"ebnf": EBNF}, None)):
        body = {"text": "go", "sampling_params": {"max_new_tokens": 50, "temperature": 0, **sp}}
        out = http.post("/generate", json=body).json()
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert re.fullmatch(pattern or r"answer: (yes|no) \([0-9]{1,2}\)", out["text"])
    body = {"text": "go", "sampling_params": {"max_new_tokens": 80, "json_schema": schema}}
    out = http.post("/generate", json=body).json()
    jsonschema.validate(json.loads(out["text"]), schema)


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "bogus"}}, "response_format.type"),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
    ),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
        "response_format.json_schema.x",
    ),
    (
        "/v1/chat/completions",
        {"response_format": _schema_format({"type": "object", "properties": 5}, 0)},
        "response_format.json_schema.schema",
    ),
    ("/v1/chat/completions", {"json_schema": "{not json"}, "json_schema"),
    ("/v1/completions", {"regex": "(unclosed"}, "regex"),
    ("/v1/completions", {"regex": ""}, "regex"),
    ("/v1/completions", {"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ("/v1/completions", {"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    (
        "/v1/completions",
        {"response_format": {"type": "json_object"}, "regex": "a"},
        "regex",
    ),
    ("/generate", {"sampling_params": {"regex": "(("}}, "sampling_params.regex"),
    ("/generate", {"sampling_params": {"ebnf": "root ::= "}}, "sampling_params.ebnf"),
    ("/generate", {"sampling_params": {"json_schema": "[1"}}, "sampling_params.json_schema"),
]


@pytest.mark.parametrize("path,extra,param", BAD)
def test_bad_grammars_are_400s_naming_the_field_and_serving_goes_on(http, path, extra, param):
    if path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    elif path == "/v1/completions":
        body = {"prompt": "hi", "max_tokens": 4, **extra}
    else:
        body = {"text": "hi", **extra}
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"] if "error" in r.json() else r.json()
    assert err.get("param") == param, err
    good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "regex": "ok"})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "ok"


def test_vllm_fields_on_both_routes(client):
    """vLLM's guided_choice / guided_regex / guided_json and structured_outputs: the output
    follows them on completions and chat, sampled with seeds so the mask shapes every token
    (json_object, unbounded, only as a spec: test_grammar_fields)."""
    choices = ["red", "green", "blue sky"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["n"], "additionalProperties": False}  # fmt: skip

    def fits(t: str) -> bool:
        jsonschema.validate(json.loads(t), schema)
        return True

    cases = [
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_regex": "[a-c]{3}x"}, lambda t: re.fullmatch("[a-c]{3}x", t)),
        ({"structured_outputs": {"json": schema}}, fits),
        ({"guided_json": schema}, fits),
    ]  # fmt: skip
    for extra, ok in cases:
        for seed in (1, 2):
            kw = dict(model="tiny-qwen", max_tokens=60, temperature=0.9, seed=seed,
                      extra_body=extra)  # fmt: skip
            comp = client.completions.create(prompt="Pick:", **kw).choices[0]
            chat = client.chat.completions.create(
                messages=[{"role": "user", "content": "Pick:"}], **kw
            ).choices[0]  # fmt: skip
            for text, reason in ((comp.text, comp.finish_reason),
                                 (chat.message.content, chat.finish_reason)):  # fmt: skip
                assert reason == "stop" and ok(text), (extra, text)
