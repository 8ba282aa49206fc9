"""Tool-call parsers: each family's format, template detection, streaming == whole parse,
and a round trip through chat templates written here (tests/server/tool_templates/)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mambaradix.server.tools import (
    TOOL_PARSERS,
    ContentDelta,
    ToolCallDelta,
    detect_tool_parser,
    get_tool_parser,
    messages_for_template,
)

TEMPLATES = Path(__file__).parent / "tool_templates"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                    "scale": {"type": "number"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
            },
        },
    },
]

# (template, parser name, assistant header, end of turn)
FAMILIES = {
    "qwen": ("qwen.jinja", "<|im_start|>assistant\n", "<|im_end|>"),
    "qwen3_coder": ("qwen3_coder.jinja", "<|im_start|>assistant\n", "<|im_end|>"),
    "granite4": ("granite4.jinja", "<|start_of_role|>assistant<|end_of_role|>", "<|end_of_text|>"),
    "lfm2": ("lfm2.jinja", "<|im_start|>assistant\n", "<|im_end|>"),
    "nemotron": ("nemotron.jinja", "<SPECIAL_11>Assistant\n", "<SPECIAL_12>"),
}

CALLS = [
    ("get_weather", {"city": "São Paulo", "days": 3, "metric": True, "hours": [6, 12]}),
    ("search", {"query": "a <b> & 'c'", "filters": {"lang": "en", "n": 2}}),
]


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)  # transformers' tojson
    return env


def render(family: str, messages, tools=None, add_generation_prompt=False) -> str:
    src = (TEMPLATES / FAMILIES[family][0]).read_text()
    return (
        _env()
        .from_string(src)
        .render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
    )


def _openai_calls(calls):
    return [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)
    ]


def _history():
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in São Paulo, then search."},
        {"role": "assistant", "content": "Checking.", "tool_calls": _openai_calls(CALLS)},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 21}'},
        {"role": "user", "content": "Thanks"},
    ]


def _summary(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser, chunks):
    s = parser.stream(TOOLS)
    deltas = []
    for ch in chunks:
        deltas += s.feed(ch)
    deltas += s.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, dict] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert c["id"] is None and c["arguments"] == "", "id + name come first"
                c["id"], c["name"] = d.id, d.name
            c["arguments"] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    assert all(c["id"].startswith("call_") for c in calls.values())
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def _random_chunks(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# ---- templates: detection, round trip ---------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_detect_from_template(family):
    assert detect_tool_parser((TEMPLATES / FAMILIES[family][0]).read_text()) == family


def test_detect_none_and_unknown_name():
    assert detect_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_tool_parser(None) is None
    with pytest.raises(ValueError, match="qwen3_coder"):
        get_tool_parser("bogus")
    assert type(get_tool_parser("pythonic")) is type(get_tool_parser("lfm2"))
    assert type(get_tool_parser("qwen25")) is type(get_tool_parser("hermes"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_template_round_trip(family):
    """The template's own rendering of an assistant tool-call turn parses back to the
    same calls; rendering the whole history (tools listing, tool results) yields exactly
    the history's calls (instruction examples in the system prompt are not calls)."""
    _, header, eot = FAMILIES[family]
    msgs = messages_for_template(_history())
    full = render(family, msgs, tools=TOOLS, add_generation_prompt=True)
    assert '{"temp": 21}' in full and "get_weather" in full.split(header)[0]
    turn = full.split(header)[1].split(eot)[0]
    parser = get_tool_parser(family)
    content, calls = parser.parse(turn, TOOLS)
    assert _summary(calls) == CALLS
    assert content.strip() == "Checking."
    _, all_calls = parser.parse(full, TOOLS)
    assert _summary(all_calls) == CALLS
    # negative control: without the tool schemas no name is known, so nothing is a call
    assert parser.parse(turn, [])[1] == []
    assert _stream(parser, list(turn)) == (content, CALLS)


# ---- per-format parsing -----------------------------------------------------------------


def test_qwen_json_and_malformed_left_as_content():
    p = get_tool_parser("qwen")
    ok = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
    bad = '<tool_call>{"name": "search", "arguments": {"query": </tool_call>'
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls = p.parse("A" + ok + bad + unknown + "<tool_call>open", TOOLS)
    assert _summary(calls) == [("search", {"query": "x"})]
    assert content == "A" + bad + unknown + "<tool_call>open"
    out = calls[0].to_openai()
    assert out["type"] == "function" and out["id"].startswith("call_")
    assert json.loads(out["function"]["arguments"]) == {"query": "x"}


def test_qwen3_coder_types_from_schema():
    p = get_tool_parser("qwen3_coder")
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
        "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _, calls = p.parse(text, TOOLS)
    assert _summary(calls) == [
        ("get_weather", {"city": "007", "days": 3, "metric": False, "hours": [1, 2], "scale": 1.5})
    ]
    # not an integer: kept as the text the model wrote
    _, calls = p.parse(text.replace("\n3\n", "\nthree\n"), TOOLS)
    assert json.loads(calls[0].arguments)["days"] == "three"
    # stray text inside the block: malformed, left as content
    content, calls = p.parse("<tool_call>junk<function=search></function></tool_call>", TOOLS)
    assert calls == [] and content.startswith("<tool_call>junk")


def test_lfm2_pythonic_literals_and_rejections():
    p = get_tool_parser("lfm2")
    s, e = "<|tool_call_start|>", "<|tool_call_end|>"
    text = f'{s}[get_weather(city="Oslo", days="2", metric=true), search(query=5)]{e}Done.'
    content, calls = p.parse(text, TOOLS)
    assert content == "Done."
    assert _summary(calls) == [
        ("get_weather", {"city": "Oslo", "days": 2, "metric": True}),
        ("search", {"query": "5"}),
    ]
    for bad in ["[get_weather(__import__('os'))]", "[get_weather(city=x.y)]", "[1 +]"]:
        assert p.parse(s + bad + e, TOOLS) == (s + bad + e, [])
    _, calls = p.parse(s + '[{"name": "search", "arguments": {"query": "q"}}]' + e, TOOLS)
    assert _summary(calls) == [("search", {"query": "q"})]


def test_nemotron_list():
    p = get_tool_parser("nemotron")
    text = (
        'Sure.<TOOLCALL>[{"name": "search", "arguments": {"query": "a"}}, '
        '{"name": "get_weather", "arguments": {"city": "b"}}]</TOOLCALL>'
    )
    content, calls = p.parse(text, TOOLS)
    assert content == "Sure."
    assert _summary(calls) == [("search", {"query": "a"}), ("get_weather", {"city": "b"})]


def test_messages_for_template_rejects_bad_arguments():
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\]"):
        messages_for_template(msgs)


# ---- streaming ---------------------------------------------------------------------------


def test_stream_holds_back_partial_marker():
    s = get_tool_parser("qwen").stream(TOOLS)
    assert [d.text for d in s.feed("Hi <tool")] == ["Hi "]
    assert s.feed("_call>{") == []
    out = s.feed('"name": "search", "arguments": {}}</tool_call> <t')
    assert [type(d) for d in out] == [ToolCallDelta, ToolCallDelta, ContentDelta]
    assert out[0].to_openai() == {
        "index": 0,
        "id": out[0].id,
        "type": "function",
        "function": {"name": "search", "arguments": ""},
    }
    assert out[2].text == " " and s.has_tool_calls
    assert [d.text for d in s.feed("able")] == ["<table"]
    assert s.finish() == []


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stream_equals_parse_random_splits(family):
    _, header, eot = FAMILIES[family]
    full = render(family, messages_for_template(_history()), tools=TOOLS)
    parser = get_tool_parser(family)
    content, calls = parser.parse(full, TOOLS)
    expected = (content, _summary(calls))
    rng = random.Random(1234)
    for _ in range(30):
        assert _stream(parser, _random_chunks(full, rng)) == expected
    assert _stream(parser, list(full)) == expected
    assert _stream(parser, [full]) == expected


def _pieces(family):
    p = TOOL_PARSERS[family]()
    msgs = messages_for_template(_history())
    turn = render(family, msgs).split(FAMILIES[family][1])[1].split(FAMILIES[family][2])[0]
    return [turn, p.start, p.end, p.start[:3], p.end[:4], "<", "x", "\n", p.start + "{bad"]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), family=st.sampled_from(sorted(FAMILIES)))
def test_stream_equals_parse_hypothesis(data, family):
    text = "".join(data.draw(st.lists(st.sampled_from(_pieces(family)), max_size=8)))
    parser = get_tool_parser(family)
    content, calls = parser.parse(text, TOOLS)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=10))))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert _stream(parser, chunks) == (content, _summary(calls))
