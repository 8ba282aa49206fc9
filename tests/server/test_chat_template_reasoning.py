"""chat_template_kwargs (enable_thinking), add_generation_prompt, continue_final_message,
--chat-template and --reasoning-parser, on a second server over the session's engine with a
thinking template written here."""

from __future__ import annotations

import itertools
import json

import openai
import pytest

from mambaradix.config import ServerConfig
from mambaradix.server.launch import ServerThread
from mambaradix.server.reasoning import ReasoningSplitter, starts_in_reasoning

# Qwen3-style: the generation prompt opens a think block unless enable_thinking is false, in
# which case it holds an empty closed one.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
    "{% if shout is defined %}[{{ shout }}]{% endif %}"
)
MSGS = [{"role": "user", "content": "why?"}]


@pytest.fixture(scope="module")
def think_server(engine):
    cfg = ServerConfig(port=0, served_model_name="tiny-qwen", chat_template=THINK_TEMPLATE,
                       reasoning_parser="qwen3")  # fmt: skip
    with ServerThread(engine, cfg) as st:
        yield st


@pytest.fixture()
def tclient(think_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=think_server.base_url + "/v1", api_key="x", max_retries=0)


def _prompt_ids(client, **kw):
    r = client.chat.completions.create(
        model="tiny-qwen", messages=kw.pop("messages", MSGS), max_tokens=1, temperature=0,
        extra_body={"return_token_ids": True, **kw},
    )  # fmt: skip
    return r, r.choices[0].model_extra["prompt_token_ids"]


def test_chat_template_kwargs_reach_the_template(tclient, engine) -> None:
    tok = engine.tokenizer
    _, on = _prompt_ids(tclient)
    _, off = _prompt_ids(tclient, chat_template_kwargs={"enable_thinking": False})
    _, shout = _prompt_ids(tclient, chat_template_kwargs={"shout": "LOUD"})
    assert tok.decode(on).endswith("<think>\n")
    assert tok.decode(off).endswith("<think>\n\n</think>\n\n")
    assert tok.decode(shout).endswith("[LOUD]")


def test_continue_final_message(tclient, engine) -> None:
    msgs = [*MSGS, {"role": "assistant", "content": "Because the"}]
    _, ids = _prompt_ids(tclient, messages=msgs, continue_final_message=True,
                         add_generation_prompt=False)  # fmt: skip
    assert engine.tokenizer.decode(ids).endswith("Because the")
    _, ids = _prompt_ids(tclient, messages=MSGS, add_generation_prompt=False)
    assert engine.tokenizer.decode(ids).endswith("<|im_end|>\n")


def test_reasoning_parser_splits_the_reply(tclient, think_server, engine) -> None:
    kw = dict(model="tiny-qwen", messages=MSGS, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    # the prompt opened a think block: the whole (random-model) reply is reasoning
    r = tclient.chat.completions.create(**kw).choices[0].message
    raw = (
        tclient.chat.completions.create(
            **{**kw, "extra_body": {"ignore_eos": True, "separate_reasoning": False}}
        )
        .choices[0]
        .message
    )
    assert raw.model_extra.get("reasoning_content") is None and raw.content
    assert r.model_extra["reasoning_content"] + (r.content or "") == raw.content
    assert r.content is None
    # thinking off: the prompt closed the block, the reply is content
    off = tclient.chat.completions.create(
        **{**kw, "extra_body": {"ignore_eos": True,
                                "chat_template_kwargs": {"enable_thinking": False}}}
    ).choices[0].message  # fmt: skip
    assert off.content and off.model_extra.get("reasoning_content") is None
    # streamed: reasoning_content deltas add up to the same text
    chunks = list(tclient.chat.completions.create(stream=True, **kw))
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks if c.choices
    )  # fmt: skip
    assert streamed == r.model_extra["reasoning_content"]
    # stream_reasoning false: the reasoning arrives in one piece
    chunks = list(
        tclient.chat.completions.create(
            stream=True, **{**kw, "extra_body": {"ignore_eos": True, "stream_reasoning": False}}
        )
    )
    pieces = [
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices
    ]
    pieces = [p for p in pieces if p]
    assert pieces == [r.model_extra["reasoning_content"]]


ANSWER = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}},
}  # fmt: skip


def test_structured_output_binds_the_answer_not_the_reasoning(tclient) -> None:
    """With --reasoning-parser a response_format applies after the think block: the reasoning
    is the model's own (the tiny model never closes its block, so the whole reply is the free
    reply's reasoning, also unsplit), and with thinking off the reply is the JSON at once."""
    kw = dict(model="tiny-qwen", messages=MSGS, max_tokens=10, temperature=0)
    free = tclient.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    bound = tclient.chat.completions.create(
        **kw, response_format=ANSWER, extra_body={"ignore_eos": True}
    ).choices[0]  # fmt: skip
    assert (
        bound.message.model_extra["reasoning_content"]
        == free.message.model_extra["reasoning_content"]
    )
    assert bound.message.content is None and bound.finish_reason == "length"
    raw = tclient.chat.completions.create(
        **kw, response_format=ANSWER, extra_body={"ignore_eos": True, "separate_reasoning": False}
    ).choices[0]  # fmt: skip
    assert raw.message.content == free.message.model_extra["reasoning_content"]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    answer = tclient.chat.completions.create(
        **{**kw, "max_tokens": 30}, response_format=ANSWER, extra_body=off
    ).choices[0]  # fmt: skip
    assert json.loads(answer.message.content) in ({"ok": True}, {"ok": False})
    assert answer.message.model_extra.get("reasoning_content") is None
    assert answer.finish_reason == "stop"


def test_thinking_token_budget_caps_the_reasoning(tclient, server, engine) -> None:
    """vLLM's thinking_token_budget: the reasoning is the free reply's first N tokens, then
    the block is closed for the model and the rest is its answer; 0 closes it at once. Without
    a reasoning parser the field is a 400 naming it."""
    kw = dict(model="tiny-qwen", messages=MSGS, max_tokens=14, temperature=0)
    free = tclient.chat.completions.create(
        **kw, extra_body={"ignore_eos": True, "return_token_ids": True}
    ).choices[0]  # fmt: skip
    ids = free.model_extra["token_ids"]
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    for budget in (0, 3):
        r = tclient.chat.completions.create(
            **kw, extra_body={"ignore_eos": True, "thinking_token_budget": budget,
                              "return_token_ids": True},
        ).choices[0]  # fmt: skip
        assert r.model_extra["token_ids"][: budget + len(end)] == ids[:budget] + end
        want = engine.tokenizer.decode(ids[:budget])
        assert (r.message.model_extra.get("reasoning_content") or "") == want
        assert r.message.content
    raw = tclient.chat.completions.create(
        **kw, extra_body={"ignore_eos": True, "thinking_token_budget": 3,
                          "separate_reasoning": False},
    ).choices[0].message.content  # fmt: skip
    assert raw.startswith(engine.tokenizer.decode(ids[:3]) + "</think>")
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        tclient.chat.completions.create(**kw, extra_body={"thinking_token_budget": -1})
    plain = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="reasoning-parser"):
        plain.chat.completions.create(**kw, extra_body={"thinking_token_budget": 3})


@pytest.mark.parametrize(
    "text, in_reasoning, want",
    [
        ("<think>abc</think>\n\nhello", False, ("abc", "hello")),
        ("  <think>a<b</think>x", False, ("a<b", "x")),
        ("plain <think>not</think>", False, ("", "plain <think>not</think>")),
        ("abc</think>  done", True, ("abc", "done")),
        ("still thinking </thi", True, ("still thinking </thi", "")),
        ("<thi", False, ("", "<thi")),
        ("", True, ("", "")),
    ],
)
def test_reasoning_splitter_at_every_chunking(text, in_reasoning, want) -> None:
    for cuts in itertools.chain([()], itertools.combinations(range(1, len(text)), 2)):
        bounds = [0, *cuts, len(text)]
        sp = ReasoningSplitter(in_reasoning)
        r, c = "", ""
        for a, b in zip(bounds, bounds[1:]):
            dr, dc = sp.feed(text[a:b])
            r, c = r + dr, c + dc
        dr, dc = sp.flush()
        assert (r + dr, c + dc) == want, (cuts, r + dr, c + dc)


def test_starts_in_reasoning() -> None:
    assert starts_in_reasoning("qwen3", "x<think>\n", {})
    assert not starts_in_reasoning("qwen3", "x<think>\n\n</think>\n\n", {})
    assert not starts_in_reasoning("qwen3", "x", {})
    assert starts_in_reasoning("deepseek-r1", "x", {})
    assert not starts_in_reasoning("deepseek-r1", "x", {"enable_thinking": False})
