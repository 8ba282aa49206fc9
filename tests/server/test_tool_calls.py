"""Tool calls through the chat route with the ``openai`` client, for each parser, over the
tiny random-weight model served with the templates written here (tests/server/tool_templates/,
parser detected from their markers):

- ``tool_choice`` named / required: constrained decoding yields one valid call of the right
  function whose arguments validate against its schema (control: ``auto`` gives none);
- ``auto``: a reply forced (``regex``) to a known call text is parsed into ``tool_calls``,
  streamed (``tool_calls`` deltas) and non-streamed alike, ``finish_reason: "tool_calls"``;
- the history (assistant ``tool_calls``, ``tool`` messages, ``tools``) goes through the
  template: the prompt equals the template's own rendering; the next turn of a tool loop keeps
  the cache hit;
- bad ``tools`` / ``tool_choice`` / history are 400s naming the field.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_tool_parsers import FAMILIES, TEMPLATES

from mambaradix.config import ServerConfig
from mambaradix.server.launch import ServerThread
from mambaradix.server.tools import messages_for_template

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 16},
        "limit": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
]
SCHEMA = {"get_weather": WEATHER, "search": SEARCH}
ARGS = {"query": "a b", "limit": 3}
_JSON_CALL = '{"name": "search", "arguments": {"query": "a b", "limit": 3}}'
KNOWN = {  # the call of search(ARGS) as each family's model writes it
    "qwen": f"<tool_call>{_JSON_CALL}</tool_call>",
    "granite4": f"<tool_call>\n{_JSON_CALL}\n</tool_call>",
    "nemotron": f"<TOOLCALL>[{_JSON_CALL}]</TOOLCALL>",
    "qwen3_coder": "<tool_call>\n<function=search>\n<parameter=query>\na b\n</parameter>\n"
    "<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>",
    "lfm2": '<|tool_call_start|>[search(query="a b", limit=3)]<|tool_call_end|>',
}
USER = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fam(request, engine):
    name = request.param
    cfg = ServerConfig(
        port=0, served_model_name="tiny-qwen", chat_template=str(TEMPLATES / FAMILIES[name][0])
    )
    with ServerThread(engine, cfg) as st:
        yield name, st


@pytest.fixture()
def oai(fam):
    import openai

    return openai.OpenAI(base_url=fam[1].base_url + "/v1", api_key="x", max_retries=0)


def _chat(oai, stream: bool = False, **kw):
    """(content, [(name, args)], finish_reason, raw calls) of one chat request."""
    kw = {"model": "tiny-qwen", "messages": USER, "max_tokens": 200, "temperature": 0, **kw}
    if not stream:
        c = oai.chat.completions.create(**kw).choices[0]
        calls = c.message.tool_calls or []
        got = [(t.function.name, json.loads(t.function.arguments)) for t in calls]
        return c.message.content, got, c.finish_reason, calls
    content, parts, reason, fragments = "", {}, None, 0
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                p = parts.setdefault(t.index, {"name": None, "args": "", "id": None})
                if t.id:
                    p["id"], p["name"] = t.id, t.function.name
                p["args"] += t.function.arguments or ""
                fragments += 1
            reason = ch.finish_reason or reason
    got = [(p["name"], json.loads(p["args"])) for _, p in sorted(parts.items())]
    assert all(p["id"] and p["id"].startswith("call_") for p in parts.values())
    return content or None, got, reason, fragments


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_choice_give_a_valid_call(oai, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, reason, _ = _chat(oai, stream, tools=TOOLS, tool_choice=named)
    assert reason == "tool_calls" and content is None, (content, calls)
    assert [n for n, _ in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER)
    _, calls, reason, _ = _chat(oai, stream, tools=TOOLS, tool_choice="required", seed=3)
    assert reason == "tool_calls" and len(calls) == 1 and calls[0][0] in SCHEMA
    jsonschema.validate(calls[0][1], SCHEMA[calls[0][0]])


def test_control_auto_without_forcing_makes_no_call(oai):
    _, calls, reason, _ = _chat(oai, tools=TOOLS, tool_choice="auto", max_tokens=30)
    assert calls == [] and reason != "tool_calls"


def test_auto_parses_a_known_call_streamed_and_whole_alike(oai, fam):
    text = "Let me check. " + KNOWN[fam[0]]
    kw = {"tools": TOOLS, "extra_body": {"regex": re.escape(text)}}
    whole = _chat(oai, **kw)
    streamed = _chat(oai, stream=True, **kw)
    assert whole[:3] == ("Let me check. ", [("search", ARGS)], "tool_calls")
    assert streamed[:3] == whole[:3]


def _history(call_args: str) -> list[dict]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in São Paulo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call_args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]


def test_history_round_trip_through_the_template(oai, fam, engine):
    history = _history('{"city": "São Paulo", "days": 2}')
    r = oai.chat.completions.create(
        model="tiny-qwen", messages=history, tools=TOOLS, max_tokens=1,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    got = r.choices[0].model_extra["prompt_token_ids"]
    tok = engine.tokenizer
    msgs = messages_for_template([{**m, "content": m["content"] or ""} for m in history])
    src = (TEMPLATES / FAMILIES[fam[0]][0]).read_text()
    want = tok.apply_chat_template(
        msgs, tools=TOOLS, chat_template=src, tokenize=False, add_generation_prompt=True
    )
    assert got == tok.encode(want, add_special_tokens=False)
    text = tok.decode(got)
    assert "São Paulo" in text and '{"temp": 21}' in text and "get_weather" in text


def test_tool_loop_keeps_the_cache_hit(oai, fam, engine):
    """Turn 1 forces a call; turn 2 sends it back with the tool's result; turn 3 adds the
    answer and a new question. Each next turn resumes at least where the previous prompt's
    exact-repeat snapshot is (the template re-renders the history unchanged), and never past
    the tokens the two turns share."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    msgs = list(USER)
    r1 = oai.chat.completions.create(
        model="tiny-qwen", messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=200,
        temperature=0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    call = r1.choices[0].message.tool_calls[0]
    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r2 = oai.chat.completions.create(
        model="tiny-qwen", messages=msgs, tools=TOOLS, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    msgs += [
        {"role": "assistant", "content": r2.choices[0].message.content},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r3 = oai.chat.completions.create(
        model="tiny-qwen", messages=msgs, tools=TOOLS, max_tokens=2, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    align = engine.scheduler.strategy.repeat_align
    for prev, nxt in ((r1, r2), (r2, r3)):
        prompt = prev.choices[0].model_extra["prompt_token_ids"]
        seen = prompt + prev.choices[0].model_extra["token_ids"]
        new = nxt.choices[0].model_extra["prompt_token_ids"]
        shared = next((i for i, (a, b) in enumerate(zip(seen, new)) if a != b), len(seen))
        assert shared >= len(prompt), "the template rewrote the previous prompt"
        cached = nxt.usage.prompt_tokens_details.cached_tokens
        assert (len(prompt) - 1) // align * align <= cached <= shared


def _fn(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BAD = [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    (
        {"tools": [_fn("f", {"type": "string"})]},
        "tools.0.function.parameters",
    ),
    (
        {"tools": [_fn("f", {"properties": 5})]},
        "tools.0.function.parameters",
    ),
    ({"tools": [{"type": "web", "function": {"name": "f"}}]}, "tools.0.type"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tools"),  # this server's template renders no tool calls
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"messages": _history("not json")}, "messages.2.tool_calls.0.function.arguments"),
    ({"messages": _history('{"a": 1}')[:2] + [{"role": "tool", "tool_call_id": 5}]},
     "messages.2.tool_call_id"),
]  # fmt: skip


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_tools_are_400s_naming_the_field(server, extra, param):
    import httpx

    body = {"messages": USER, "max_tokens": 2, **extra}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param or err["param"].startswith(param + "."), err
        assert (
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
        )
