"""The real ``openai`` client against the server: completions, chat, streaming, cached tokens."""

from __future__ import annotations

import json
import random

import openai
import pytest

ALIGN = 64  # snapshot alignment: max(64, page_size)
MODEL = "tiny-qwen"


def _ids(engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, len(engine.tokenizer)) for _ in range(n)]


def test_completion_text_prompt(client: openai.OpenAI, engine) -> None:
    prompt = "the quick brown fox"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and len(r.choices) == 1
    assert isinstance(r.choices[0].text, str) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_completion_token_ids_and_batch(client: openai.OpenAI, engine) -> None:
    a, b = _ids(engine, 20, 1), _ids(engine, 30, 2)
    r = client.completions.create(
        model=MODEL,
        prompt=[a, b],
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == 50 and r.usage.completion_tokens == 8
    for choice, prompt in zip(r.choices, (a, b)):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) == 4
        # the text is the detokenized ids
        assert choice.text == engine.tokenizer.decode(extra["token_ids"], skip_special_tokens=True)
    one = client.completions.create(model=MODEL, prompt=a, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert one.choices[0].text == r.choices[0].text  # greedy: batching does not change output


def test_chat_uses_template(client: openai.OpenAI, engine) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    tok = engine.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens_details.cached_tokens is not None


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "count to five"}]
    full = client.chat.completions.create(messages=messages, **kw)
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    finals = [f for f in finals if f]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    # without include_usage no chunk carries usage
    plain = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)

    comp = list(client.completions.create(prompt="abc", stream=True, **kw))
    assert sum(1 for c in comp if c.choices[0].finish_reason == "length") == 1


def test_cached_tokens_shared_prefix_and_repeat(client: openai.OpenAI, engine) -> None:
    system = _ids(engine, 150, 10)  # aligned: 128
    cached, outputs = [], []
    for i in range(4):
        prompt = system + _ids(engine, 12, 100 + i)
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        outputs.append(r.choices[0].text)
    assert cached[0] == 0  # negative control: a fresh random prompt cannot hit
    assert all(c >= 128 for c in cached[2:]), cached
    assert all(c < 150 + 12 for c in cached)

    # exact repeat of the last prompt (L = 162): at least align_down(161) = 128
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens_details.cached_tokens >= (len(prompt) - 1) // ALIGN * ALIGN
    assert r.choices[0].text == outputs[-1]  # the cache never changes greedy output


def test_models_and_health(client: openai.OpenAI, http) -> None:
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL]
    assert http.get("/health").json() == {"status": "ok"}
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] > 0 and card["vocab_size"] > 0


def test_extensions_logprobs_and_seed(http) -> None:
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 1.0, "seed": 7, "top_k": 50,
            "min_p": 0.001, "ignore_eos": True, "logprobs": 1,
            "return_token_ids": True}  # fmt: skip
    a = http.post("/v1/completions", json=body).json()["choices"][0]
    b = http.post("/v1/completions", json=body).json()["choices"][0]
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 6  # seeded: reproducible
    lps = a["logprobs"]["token_logprobs"]
    assert len(lps) == 6 and all(x <= 0 for x in lps)
    # streamed: every token id and logprob arrives, even those whose text was held back
    ids, stream_lps = [], []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids += c["token_ids"]
                    stream_lps += (c["logprobs"] or {}).get("token_logprobs", [])
    assert ids == a["token_ids"] and stream_lps == pytest.approx(lps)
    # a stop token id ends the completion at its first occurrence
    stop_at = a["token_ids"][2]
    first = a["token_ids"].index(stop_at)
    c = http.post("/v1/completions", json={**body, "stop_token_ids": [stop_at]}).json()
    assert c["choices"][0]["finish_reason"] == "stop"
    assert c["usage"]["completion_tokens"] == first + 1


def test_batch_with_shared_prefix_hits_together(client: openai.OpenAI, engine) -> None:
    system = _ids(engine, 140, 20)
    prompts = [system + _ids(engine, 10, 200 + i) for i in range(3)]
    r = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=2, temperature=0, extra_body={"ignore_eos": True}
    )
    # arriving together: all but the first resume at align_down(140) = 128
    assert r.usage.prompt_tokens_details.cached_tokens >= 2 * 128
