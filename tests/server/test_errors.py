"""Bad input gets HTTP 400 with an OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import json

import pytest

GOOD = {"prompt": "hello", "max_tokens": 2, "temperature": 0}


def _bad_bodies(engine) -> list[tuple[str, str, object]]:
    ctx = engine.context_length
    return [
        ("prompt longer than the context", "/v1/completions", {"prompt": [5] * (ctx + 1)}),
        ("prompt fills the context", "/v1/completions", {"prompt": [5] * ctx, "max_tokens": 1}),
        ("negative max_tokens", "/v1/completions", {**GOOD, "max_tokens": -1}),
        ("huge max_tokens", "/v1/completions", {**GOOD, "max_tokens": 10**9}),
        ("huge chat max_tokens", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**9}),
        ("negative temperature", "/v1/completions", {**GOOD, "temperature": -0.5}),
        ("temperature above 2", "/v1/completions", {**GOOD, "temperature": 7}),
        ("top_p zero", "/v1/completions", {**GOOD, "top_p": 0}),
        ("top_p above 1", "/v1/completions", {**GOOD, "top_p": 1.5}),
        ("top_k zero", "/v1/completions", {**GOOD, "top_k": 0}),
        ("min_p above 1", "/v1/completions", {**GOOD, "min_p": 3}),
        ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-17"}),
        ("malformed JSON", "/v1/completions", '{"prompt": "x", '),
        ("body not an object", "/v1/completions", "[1, 2]"),
        ("empty messages", "/v1/chat/completions", {"messages": []}),
        ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}),
        ("unknown role", "/v1/chat/completions",
         {"messages": [{"role": "wizard", "content": "x"}]}),
        ("missing prompt", "/v1/completions", {"max_tokens": 3}),
        ("prompt wrong type", "/v1/completions", {"prompt": 5}),
        ("empty prompt", "/v1/completions", {"prompt": ""}),
        ("empty token list", "/v1/completions", {"prompt": []}),
        ("token id out of range", "/v1/completions", {"prompt": [1, 10**7]}),
        ("max_tokens wrong type", "/v1/completions", {**GOOD, "max_tokens": "many"}),
        ("stream wrong type", "/v1/completions", {**GOOD, "stream": {"a": 1}}),
        ("stop wrong type", "/v1/completions", {**GOOD, "stop": 3}),
        ("n too large", "/v1/completions", {**GOOD, "n": 1000}),
    ]  # fmt: skip


def test_every_bad_input_is_a_400_and_the_server_keeps_serving(http, engine, wait_idle) -> None:
    before = engine.stats().finished_requests
    for name, path, body in _bad_bodies(engine):
        content = body if isinstance(body, str) else json.dumps(body)
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, name
        assert err["message"] and err["type"] == "invalid_request_error", (name, err)
        ok = http.post("/v1/completions", json=GOOD)  # a normal request right after
        assert ok.status_code == 200, (name, ok.text)
        assert ok.json()["usage"]["completion_tokens"] >= 1
    wait_idle()
    engine.check_integrity()
    # only the good requests reached the engine
    assert engine.stats().finished_requests - before == len(_bad_bodies(engine))


@pytest.mark.parametrize(
    "body, param",
    [
        ({**GOOD, "max_tokens": -1}, "max_tokens"),
        ({**GOOD, "temperature": -1}, "temperature"),
        ({**GOOD, "top_p": 2}, "top_p"),
        ({**GOOD, "model": "nope"}, "model"),
        ({**GOOD, "max_tokens": "x"}, "max_tokens"),
    ],
)
def test_error_names_the_parameter(http, body, param) -> None:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_unknown_route_is_an_openai_style_404(http) -> None:
    r = http.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404 and "message" in r.json()["error"]
