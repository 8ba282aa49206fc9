"""Logprobs (chat top_logprobs, completions logprobs=N, echo with prompt logprobs, max_tokens 0,
real bytes) and the sampling fields (logit_bias, penalties, min_tokens, n sharing the prefill,
seeds), through the ``openai`` client; each sampling field with a check that fails if it were
ignored."""

from __future__ import annotations

import math
import random

import openai
import pytest
import torch
from hf_oracle import hf_logprobs

MODEL = "tiny-qwen"


def _ids(engine, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, len(engine.tokenizer)) for _ in range(n)]


def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 5 == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 20
        lps = [t.logprob for t in item.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the chosen token is the best alternative
        assert item.top_logprobs[0].token == item.token
        assert item.logprob == pytest.approx(lps[0])
        assert bytes(item.bytes).decode("utf-8", "replace") or item.bytes == []
        assert sum(math.exp(x) for x in lps) <= 1.0 + 1e-5


def test_completion_logprobs_fields(client: openai.OpenAI, engine) -> None:
    r = client.completions.create(
        model=MODEL, prompt="the quick brown fox", max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    ids = r.choices[0].model_extra["token_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert len(lp.text_offset) == 6 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    text = r.choices[0].text
    tok = engine.tokenizer
    for i in range(len(ids)):  # each offset is where that token's text starts
        assert lp.text_offset[i] == len(tok.decode(ids[:i]))
    assert text == tok.decode(ids)
    for top, chosen_lp in zip(lp.top_logprobs, lp.token_logprobs):
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(chosen_lp)


def test_echo_max_tokens_0_prompt_logprobs_equal_a_full_forward(
    client: openai.OpenAI, engine, hf_model, http
) -> None:
    """The lm-eval-harness loglikelihood request, on a prompt already in the cache: the
    prompt logprobs are all there and equal the oracle's (a cache hit would have skipped the
    positions they need)."""
    ids = _ids(engine, 150, 7)
    warm = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    warm2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0)
    assert warm2.usage.prompt_tokens_details.cached_tokens >= 64  # the prefix is cached
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=5, temperature=0
    )
    choice = r.choices[0]
    assert r.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    ref = hf_logprobs(hf_model, ids)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    best = ref[:-1].max(dim=-1).values
    for i in range(1, len(ids)):
        assert max(lp.top_logprobs[i].values()) == pytest.approx(best[i - 1].item(), abs=1e-4)
    assert choice.text == engine.tokenizer.decode(ids)
    del warm
    # max_tokens 1 (the other shape lm-eval sends): the prompt part is the same, plus 1 token
    r1 = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    lp1 = r1.choices[0].logprobs
    assert len(lp1.token_logprobs) == len(ids) + 1
    assert torch.allclose(torch.tensor(lp1.token_logprobs[1 : len(ids)]), want, atol=1e-4)


def test_streamed_echo_logprobs_match_non_streamed(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="hello world", max_tokens=4, temperature=0, logprobs=2,
              echo=True, extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    text = "".join(c.choices[0].text for c in chunks)
    lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    offs = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert text == full.text and lps == full.logprobs.token_logprobs
    assert offs == full.logprobs.text_offset


def test_partial_utf8_tokens_report_their_own_bytes(engine) -> None:
    from mambaradix.server.logprobs import TokenTable

    tok = engine.tokenizer
    table = TokenTable(tok)
    text = "naïve — 日本語 ok"
    ids = tok.encode(text)
    raw = b"".join(table.token_bytes(t) for t in ids)
    assert raw == text.encode()  # the bytes of all tokens concatenate to the text
    partial = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert partial, "the test text should split a character across tokens"
    for t in partial:
        assert table.token_bytes(t) != "\ufffd".encode()
        assert table.token_str(t).startswith("bytes:")


def test_logit_bias_forces_a_token(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="hello", max_tokens=5, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    plain = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    target = next(t for t in range(300, 400) if t not in plain)
    r = client.completions.create(logit_bias={str(target): 100}, **kw)
    assert r.choices[0].model_extra["token_ids"] == [target] * 5
    # a -100 bias on the greedy first token moves it
    r = client.completions.create(logit_bias={str(plain[0]): -100}, **kw)
    assert r.choices[0].model_extra["token_ids"][0] != plain[0]


def _greedy(client, prompt, **extra):
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )  # fmt: skip
    return r.choices[0].model_extra["token_ids"]


def test_penalties_change_a_greedy_repetition(client: openai.OpenAI, engine) -> None:
    prompt = _ids(engine, 12, 3)
    plain = _greedy(client, prompt)
    assert len(set(plain)) < len(plain), "greedy output should repeat a token"
    for field in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"repetition_penalty": 5.0},
    ):
        got = _greedy(client, prompt, **field)
        assert got != plain, field
        assert len(set(got)) > len(set(plain)), field  # fewer repeats
    # frequency penalty through the chat route too
    msgs = [{"role": "user", "content": "count"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(frequency_penalty=2.0, **kw).choices[0].message.content
    assert a != b


def test_min_tokens_masks_eos(client: openai.OpenAI, engine) -> None:
    eos = engine.model.eos_token_ids
    kw = dict(model=MODEL, prompt="hi", max_tokens=8, temperature=0)
    # make EOS the greedy choice: without min_tokens the reply ends at once
    bias = {str(eos[0]): 100}
    r = client.completions.create(logit_bias=bias, **kw)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(logit_bias=bias, extra_body={"min_tokens": 5}, **kw)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"


def test_n_copies_share_the_prompt_prefill(client: openai.OpenAI, engine, wait_idle) -> None:
    prompt = _ids(engine, 300, 11)
    wait_idle()
    before = engine.stats().computed_prefill_tokens
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, n=8, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert len(r.choices) == 8 and r.usage.prompt_tokens == 300
    computed = engine.stats().computed_prefill_tokens - before
    # one prefill of the prompt, the other 7 resume from its snapshot (<64 tokens each),
    # plus the 8 x 2 decode steps are not counted as prefill
    assert computed < 300 + 7 * 64, computed
    assert len({c.text for c in r.choices}) > 1  # distinct seeds per copy
    again = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, n=8, temperature=1.0, seed=5,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded


def test_n_64(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=64, temperature=1)
    assert sorted(c.index for c in r.choices) == list(range(64))


def test_seeded_sampling_with_penalties_repeats(client: openai.OpenAI) -> None:
    kw = dict(
        model=MODEL,
        prompt="the model",
        max_tokens=10,
        temperature=1.0,
        seed=42,
        frequency_penalty=0.5,
        logit_bias={"100": 3},
        extra_body={"ignore_eos": True},
    )
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    c = client.completions.create(**{**kw, "seed": 43}).choices[0].text
    assert a == b and a != c
