"""Every kind of bad input is a 4xx naming the field, on a keep-alive connection that answers a
good request right after (checked on one raw HTTP/1.1 socket, which fails if the server closed
it); a 500 keeps the connection too."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest

C, CH = "/v1/completions", "/v1/chat/completions"
GOOD = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
MSG = [{"role": "user", "content": "hi"}]
GOOD_CHAT = {"messages": MSG, "max_tokens": 2, "temperature": 0}


def _c(**kw):
    return {**GOOD, **kw}


def _ch(**kw):
    return {**GOOD_CHAT, **kw}


# (name, path, body (dict, or raw str/bytes), status, param the error must name or None)
CASES = [
    # malformed bodies and encodings
    ("malformed JSON", C, '{"prompt": "x", ', 400, None),
    ("empty body", C, "", 400, None),
    ("body is an array", C, "[1, 2]", 400, None),
    ("body is a string", C, '"hi"', 400, None),
    ("invalid UTF-8", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("NaN literal", C, '{"prompt": "x", "temperature": NaN}', 400, None),
    ("Infinity literal", C, '{"prompt": "x", "top_p": Infinity}', 400, None),
    ("nested 5000 deep", C, '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, None),
    ("nested 100 deep in a field", C, '{"prompt": "x", "user": ' + "[" * 100 + "]" * 100 + "}",
     400, "user"),
    ("lone surrogate in prompt", C, '{"prompt": "ab\\ud800cd"}', 400, "prompt"),
    ("lone surrogate in prompt list", C, '{"prompt": ["ok", "\\udfff"]}', 400, "prompt.1"),
    ("lone surrogate in message", CH,
     '{"messages": [{"role": "user", "content": "x\\ud800"}]}', 400, "messages.0.content"),
    ("lone surrogate in stop", C, '{"prompt": "x", "stop": "\\ud834"}', 400, "stop"),
    # unknown fields
    ("unknown field", C, _c(frobnicate=1), 400, "frobnicate"),
    ("unknown chat field", CH, _ch(temprature=0.5), 400, "temprature"),
    ("unknown message key", CH, {"messages": [{"role": "user", "content": "x", "foo": 1}]},
     400, "messages.0.foo"),
    ("unknown stream_options key", C, _c(stream_options={"include_usage": True, "x": 1}),
     400, "stream_options.x"),
    ("chat field on completions", C, _c(messages=MSG), 400, "messages"),
    ("completions field on chat", CH, _ch(prompt="x"), 400, "prompt"),
    # peers' fields we do not implement: only their defaults pass
    ("lora_path set", C, _c(lora_path="adapter"), 400, "lora_path"),
    ("return_hidden_states true", C, _c(return_hidden_states=True), 400, "return_hidden_states"),
    ("logprob_start_len 0", C, _c(logprob_start_len=0), 400, "logprob_start_len"),
    ("response_format json_object with a schema", CH,
     _ch(response_format={"type": "json_object", "schema": {}}), 400, "response_format.schema"),
    ("response_format bogus", CH, _ch(response_format={"type": "bogus"}), 400,
     "response_format.type"),
    ("bad regex", C, _c(regex="a+("), 400, "regex"),
    ("json_schema not JSON", C, _c(json_schema='{"type": "object"'), 400, "json_schema"),
    ("regex and ebnf", C, _c(regex="a", ebnf='root ::= "a"'), 400, "ebnf"),
    ("tools with a template without tool calls", CH,
     _ch(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("tool_choice required", CH, _ch(tool_choice="required"), 400, "tool_choice"),
    ("assistant tool_calls arguments not JSON", CH, {"messages": [
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "f", "arguments": "{x"}}]},
        {"role": "user", "content": "x"}]}, 400, "messages.0.tool_calls.0.function.arguments"),
    ("guided_decoding_backend", C, _c(guided_decoding_backend="outlines"), 400,
     "guided_decoding_backend"),
    ("guided_json beside regex", C, _c(guided_json={"type": "object"}, regex="a"), 400,
     "guided_json"),
    ("structured_outputs two", C, _c(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
     "structured_outputs"),
    ("structured_outputs unknown", C, _c(structured_outputs={"structural_tag": "x"}), 400,
     "structured_outputs.structural_tag"),
    ("guided_choice empty", C, _c(guided_choice=[]), 400, "guided_choice"),
    ("use_beam_search", C, _c(use_beam_search=True), 400, "use_beam_search"),
    ("prompt_logprobs", C, _c(prompt_logprobs=1), 400, "prompt_logprobs"),
    ("suffix", C, _c(suffix="tail"), 400, "suffix"),
    ("best_of above n", C, _c(best_of=3), 400, "best_of"),
    ("priority 5", C, _c(priority=5), 400, "priority"),
    ("store true", CH, _ch(store=True), 400, "store"),
    ("modalities audio", CH, _ch(modalities=["text", "audio"]), 400, "modalities"),
    ("no_stop_trim true", C, _c(no_stop_trim=True), 400, "no_stop_trim"),
    ("stream_reasoning wrong type", CH, _ch(stream_reasoning="no"), 400, "stream_reasoning"),
    # wrong types
    ("prompt wrong type", C, {"prompt": 5}, 400, "prompt"),
    ("prompt bools", C, {"prompt": [True, False]}, 400, "prompt"),
    ("prompt float ids", C, {"prompt": [1.0, 2.0]}, 400, "prompt"),
    ("max_tokens string", C, _c(max_tokens="many"), 400, "max_tokens"),
    ("max_tokens float", C, _c(max_tokens=2.5), 400, "max_tokens"),
    ("temperature string", C, _c(temperature="hot"), 400, "temperature"),
    ("top_p bool", C, _c(top_p=True), 400, "top_p"),
    ("top_k float", C, _c(top_k=2.0), 400, "top_k"),
    ("n string", C, _c(n="2"), 400, "n"),
    ("stream object", C, _c(stream={"a": 1}), 400, "stream"),
    ("stop number", C, _c(stop=3), 400, "stop"),
    ("stop list of numbers", C, _c(stop=[1, 2]), 400, "stop"),
    ("seed string", C, _c(seed="7"), 400, "seed"),
    ("logprobs bool on completions", C, _c(logprobs=True), 400, "logprobs"),
    ("logprobs int on chat", CH, _ch(logprobs=3), 400, "logprobs"),
    ("echo string", C, _c(echo="yes"), 400, "echo"),
    ("ignore_eos int", C, _c(ignore_eos=1), 400, "ignore_eos"),
    ("stop_token_ids strings", C, _c(stop_token_ids=["a"]), 400, "stop_token_ids"),
    ("logit_bias list", C, _c(logit_bias=[1, 2]), 400, "logit_bias"),
    ("logit_bias value string", C, _c(logit_bias={"5": "lots"}), 400, "logit_bias"),
    ("logit_bias key not an id", C, _c(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("chat_template_kwargs list", CH, _ch(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("messages wrong type", CH, {"messages": "hi"}, 400, "messages"),
    ("message content number", CH, {"messages": [{"role": "user", "content": 5}]},
     400, "messages.0.content"),
    ("image content part", CH, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content"),
    ("unknown role", CH, {"messages": [{"role": "wizard", "content": "x"}]},
     400, "messages.0.role"),
    ("model number", C, _c(model=7), 400, "model"),
    # missing / empty
    ("missing prompt", C, {"max_tokens": 3}, 400, "prompt"),
    ("missing messages", CH, {"max_tokens": 3}, 400, "messages"),
    ("empty prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty token list", C, {"prompt": []}, 400, "prompt"),
    ("empty prompt in batch", C, {"prompt": ["a", ""]}, 400, "prompt"),
    ("empty messages", CH, {"messages": []}, 400, "messages"),
    ("empty stop string", C, _c(stop=[""]), 400, "stop"),
    # ranges
    ("negative max_tokens", C, _c(max_tokens=-1), 400, "max_tokens"),
    ("chat max_tokens 0", CH, _ch(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", C, _c(max_tokens=10**9), 400, "max_tokens"),
    ("huge chat max_completion_tokens", CH, _ch(max_completion_tokens=10**9), 400, "max_tokens"),
    ("negative temperature", C, _c(temperature=-0.5), 400, "temperature"),
    ("temperature above 2", C, _c(temperature=7), 400, "temperature"),
    ("top_p zero", C, _c(top_p=0), 400, "top_p"),
    ("top_p above 1", C, _c(top_p=1.5), 400, "top_p"),
    ("top_k zero", C, _c(top_k=0), 400, "top_k"),
    ("top_k -5", C, _c(top_k=-5), 400, "top_k"),
    ("min_p above 1", C, _c(min_p=3), 400, "min_p"),
    ("n zero", C, _c(n=0), 400, "n"),
    ("n 65", C, _c(n=65), 400, "n"),
    ("presence_penalty 3", C, _c(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty -2.5", CH, _ch(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("repetition_penalty 0", C, _c(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition_penalty 11", C, _c(repetition_penalty=11), 400, "repetition_penalty"),
    ("min_tokens negative", C, _c(min_tokens=-1), 400, "min_tokens"),
    ("min_tokens above max_tokens", C, _c(min_tokens=5), 400, "min_tokens"),
    ("logprobs 21", C, _c(logprobs=21), 400, "logprobs"),
    ("logprobs -1", C, _c(logprobs=-1), 400, "logprobs"),
    ("top_logprobs 21", CH, _ch(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs without logprobs", CH, _ch(top_logprobs=3), 400, "top_logprobs"),
    ("logit_bias id out of vocab", C, _c(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("logit_bias value 101", C, _c(logit_bias={"5": 101}), 400, "logit_bias"),
    ("stop_token_ids out of vocab", C, _c(stop_token_ids=[10**7]), 400, "stop_token_ids"),
    ("token id out of range", C, {"prompt": [1, 10**7]}, 400, "prompt"),
    ("negative token id", C, {"prompt": [1, -3]}, 400, "prompt"),
    ("prompt longer than the context", C, "CTX+1", 400, "prompt"),
    ("unknown model", C, _c(model="gpt-17"), 400, "model"),
    # chat template arguments
    ("chat_template_kwargs reserved key", CH, _ch(chat_template_kwargs={"messages": []}),
     400, "chat_template_kwargs.messages"),
    ("continue_final_message after user", CH, _ch(continue_final_message=True),
     400, "continue_final_message"),
    ("continue_final_message with add_generation_prompt", CH,
     {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, 400, "continue_final_message"),
    # size
    ("oversize body", C, "OVERSIZE", 413, None),
]  # fmt: skip


def _conn(server) -> http.client.HTTPConnection:
    u = urlparse(server.base_url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=60)


def _post(conn, path, body) -> tuple[int, dict]:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    raw = raw.encode() if isinstance(raw, str) else raw
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    assert not resp.will_close, f"server closed the connection after {resp.status}"
    return resp.status, json.loads(data)


def test_at_least_80_cases() -> None:
    assert len(CASES) >= 80 and len({c[0] for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def conn(server):
    c = _conn(server)
    yield c
    c.close()


@pytest.mark.parametrize("name, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_naming_the_field(conn, engine, name, path, body, status, param):
    if body == "CTX+1":
        body = {"prompt": [5] * (engine.context_length + 1)}
    elif body == "OVERSIZE":
        limit = conn_limit(engine)
        body = '{"prompt": "' + "a" * (limit + 10) + '"}'
    sock = conn.sock
    got, err = _post(conn, path, body)
    assert got == status, (name, got, err)
    e = err["error"]
    assert set(e) == {"message", "type", "param", "code"}, name
    assert e["message"] and e["type"] == "invalid_request_error", (name, e)
    if param is not None:
        assert e["param"] == param or e["param"].startswith(param + "."), (name, e)
        assert param.split(".")[-1] in e["message"] or param.split(".")[0] in e["message"], e
    ok, body_ok = _post(conn, C, GOOD)  # a normal request right after, same connection
    assert ok == 200 and body_ok["usage"]["completion_tokens"] >= 1, (name, body_ok)
    assert sock is None or conn.sock is sock, "the connection was not kept alive"


def conn_limit(engine) -> int:
    return 64 << 20  # ServerConfig.max_body_mb default


def test_peer_fields_at_their_defaults_are_accepted(conn) -> None:
    body = {
        **GOOD_CHAT,
        "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
        "lora_path": None, "logprob_start_len": -1, "tools": None, "tool_choice": "auto",
        "response_format": {"type": "text"}, "session_params": None, "priority": 0,
        "add_special_tokens": False, "include_stop_str_in_output": False, "store": False,
        "modalities": ["text"], "parallel_tool_calls": True, "stream_options": None,
        "best_of": None, "guided_json": None, "rid": None, "bootstrap_host": None,
        "presence_penalty": None, "n": None, "user": "u1",
    }  # fmt: skip
    status, resp = _post(conn, CH, body)
    assert status == 200, resp
    status, resp = _post(conn, C, _c(lora_path=None, best_of=1, suffix="", logprob_start_len=-1))
    assert status == 200, resp


def test_a_500_keeps_the_connection(server, conn, monkeypatch) -> None:
    srv = server.app.state.server

    def broken(jobs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(srv, "submit", broken)
    sock = conn.sock
    status, err = _post(conn, C, GOOD)
    assert status == 500 and "injected fault" in err["error"]["message"]
    monkeypatch.undo()
    status, ok = _post(conn, C, GOOD)
    assert status == 200 and ok["choices"][0]["text"] is not None
    assert sock is None or conn.sock is sock


def test_chat_without_a_template_is_a_400(engine) -> None:
    import copy

    from mambaradix.config import ServerConfig
    from mambaradix.server.launch import ServerThread

    class NoTemplate:  # the engine, with a tokenizer that has no chat template
        def __init__(self, eng):
            self._eng = eng
            self.tokenizer = copy.copy(eng.tokenizer)
            self.tokenizer.chat_template = None

        def __getattr__(self, name):
            return getattr(self._eng, name)

    with ServerThread(NoTemplate(engine), ServerConfig(port=0)) as st:
        c = _conn(st)
        status, err = _post(c, CH, GOOD_CHAT)
        assert status == 400 and err["error"]["code"] == "no_chat_template", err
        assert "chat template" in err["error"]["message"]
        status, _ = _post(c, C, GOOD)
        assert status == 200
        c.close()
