"""SGLang's native endpoints, with SGLang-shaped requests, checked field by field: /generate
(text, ids, batches, n, rid, stop reasons, logprobs, streaming), /get_model_info,
/get_server_info, /get_load, /flush_cache (busy and idle), /tokenize, /detokenize, /version,
the fields accepted only at their defaults, and the API key."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
import torch
from hf_oracle import hf_logprobs

from mambaradix.config import ServerConfig
from mambaradix.server.launch import ServerThread

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"}


def gen(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/generate", json=body)


def test_generate_text_fields(http, engine):
    text = "The quick brown fox jumps over the lazy dog"
    r = gen(http, text=text, sampling_params=GREEDY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert META_KEYS | {"e2e_latency"} <= set(meta)
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode(text))
    assert meta["completion_tokens"] == len(body["output_ids"]) == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert isinstance(meta["cached_tokens"], int) and meta["e2e_latency"] > 0
    assert all(isinstance(t, int) for t in body["output_ids"])
    assert body["text"] == engine.tokenizer.decode(body["output_ids"], skip_special_tokens=True)
    assert "output_token_logprobs" not in meta  # only when asked


def test_generate_ids_batch_rid_and_cached_tokens(http, wait_idle):
    prompt = list(range(10, 200))
    first = gen(http, input_ids=prompt, sampling_params=GREEDY, rid="native-rid-1")
    assert first.status_code == 200 and first.json()["meta_info"]["id"] == "native-rid-1"
    wait_idle()
    r = gen(
        http,
        input_ids=[prompt, prompt[:50]],
        sampling_params=[GREEDY, {**GREEDY, "max_new_tokens": 3}],
        rid=["b-0", "b-1"],
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["b-0", "b-1"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [6, 3]
    assert out[0]["meta_info"]["prompt_tokens"] == 190
    assert out[0]["meta_info"]["cached_tokens"] > 0  # the first request's prefix was cached
    assert out[0]["output_ids"] == first.json()["output_ids"]  # greedy: same continuation


def test_generate_n_and_stop_token(http):
    r = gen(http, text="one two three", sampling_params={**GREEDY, "n": 2})
    assert r.status_code == 200 and len(r.json()) == 2  # n copies come back as a list
    ids = r.json()[0]["output_ids"]
    stop_tok = ids[2]
    r = gen(http, text="one two three", sampling_params={**GREEDY, "stop_token_ids": [stop_tok]})
    meta = r.json()["meta_info"]
    first_hit = ids.index(stop_tok)
    assert meta["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert meta["completion_tokens"] == first_hit + 1


def test_generate_logprobs(http):
    r = gen(http, text="hello", sampling_params=GREEDY, return_logprob=True)
    body = r.json()
    lps = body["meta_info"]["output_token_logprobs"]
    assert len(lps) == 6
    assert [e[1] for e in lps] == body["output_ids"]
    assert all(e[0] <= 0.0 and e[2] is None for e in lps)
    r = gen(
        http,
        text="hello",
        sampling_params=GREEDY,
        return_logprob=True,
        return_text_in_logprobs=True,
    )
    assert all(isinstance(e[2], str) for e in r.json()["meta_info"]["output_token_logprobs"])


def _prompt(engine, n: int = 150) -> list[int]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(3, len(engine.tokenizer), (n,), generator=g).tolist()


def _check_entries(entries, ids, ref_rows, ref, decode=None):
    """``[logprob, id, text]`` entries: the ids, text as asked, logprobs = the oracle's."""
    assert [e[1] for e in entries] == ids
    assert all(e[2] == (decode([t]) if decode else None) for e, t in zip(entries, ids))
    want = ref[torch.tensor(ref_rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long)]
    got = torch.tensor([e[0] for e in entries])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def _check_tops(tops, ref_rows, ref, k):
    """Per position ``k`` entries, best first, equal to the oracle's top k."""
    assert len(tops) == len(ref_rows)
    for entries, row in zip(tops, ref_rows):
        values, ids = torch.topk(ref[row], k)
        assert len(entries) == k and [e[0] for e in entries] == sorted(
            [e[0] for e in entries], reverse=True
        )
        got = torch.tensor([e[0] for e in entries])
        assert torch.allclose(got, values, atol=1e-4)
        assert {e[1] for e in entries[:1]} <= set(ids.tolist())  # the best: same token


def test_generate_input_and_output_logprobs_as_sglang(http, engine, hf_model):
    """``return_logprob`` with SGLang's ``logprob_start_len`` s (default -1: the last prompt
    token) and ``top_logprobs_num``: ``input_token_logprobs`` lists prompt tokens s .. L-1 as
    ``[logprob, id, text|None]``, the first without a logprob (SGLang's shape); the values, the
    output logprobs and both top lists equal transformers' on the same tokens."""
    ids = _prompt(engine)
    L = len(ids)
    base = dict(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    r = gen(http, **base).json()
    meta, out = r["meta_info"], r["output_ids"]
    ref = hf_logprobs(hf_model, ids + out)
    assert meta["input_token_logprobs"] == [[None, ids[-1], None]]  # default: the last one
    _check_entries(meta["output_token_logprobs"], out, list(range(L - 1, L + 5)), ref)
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta

    for start in (0, 10, L - 1):  # the prompt is cached by now: its logprobs must still exist
        r = gen(http, **base, logprob_start_len=start, top_logprobs_num=3,
                return_text_in_logprobs=True).json()  # fmt: skip
        meta = r["meta_info"]
        assert r["output_ids"] == out
        inp = meta["input_token_logprobs"]
        assert len(inp) == L - start and inp[0] == [None, ids[start], engine.tokenizer.decode(
            [ids[start]])]  # fmt: skip
        rows = list(range(start, L - 1))  # row p predicts token p + 1
        _check_entries(inp[1:], ids[start + 1 :], rows, ref, engine.tokenizer.decode)
        _check_entries(meta["output_token_logprobs"], out, list(range(L - 1, L + 5)), ref,
                       engine.tokenizer.decode)  # fmt: skip
        assert meta["input_top_logprobs"][0] is None
        _check_tops(meta["input_top_logprobs"][1:], rows, ref, 3)
        _check_tops(meta["output_top_logprobs"], list(range(L - 1, L + 5)), ref, 3)
    assert meta["cached_tokens"] > 0  # start L - 1 lets the cached prefix be used


def test_generate_refuses_the_rid_of_a_running_request(http, engine, wait_idle):
    """A client-chosen rid the engine holds unfinished is a 400 naming ``rid``
    (``Engine.has_request``); once that request has ended the rid is free again (control).
    The stream's line iterator is kept open (a closed one hangs up, which aborts the request),
    and the engine loop is held between two steps while the clash is checked."""
    held = {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
    body = {"text": "hold this rid", "sampling_params": held, "rid": "live-rid", "stream": True}
    with http.stream("POST", "/generate", json=body) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # running
        entered, release = threading.Event(), threading.Event()

        def hold_loop() -> None:  # on the engine thread, between two steps
            entered.set()
            release.wait(60)

        paused = threading.Thread(target=engine.call, args=(hold_loop,))
        paused.start()
        try:
            assert entered.wait(60)
            assert engine.has_request("live-rid")
            r = gen(http, text="x", sampling_params=GREEDY, rid="live-rid")
        finally:
            release.set()
            paused.join()
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    wait_idle()  # leaving the stream aborted it
    assert not engine.has_request("live-rid")
    r = gen(http, text="x", sampling_params=GREEDY, rid="live-rid")
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "live-rid", r.text


def test_generate_logprob_options_per_prompt_and_streamed(http, engine):
    ids = _prompt(engine)
    r = gen(http, input_ids=[ids, ids[:20]], sampling_params=GREEDY, return_logprob=[True, True],
            logprob_start_len=[5, -1], top_logprobs_num=[0, 2])  # fmt: skip
    assert r.status_code == 200, r.text
    a, b = (o["meta_info"] for o in r.json())
    assert len(a["input_token_logprobs"]) == len(ids) - 5 and "output_top_logprobs" not in a
    assert len(b["input_token_logprobs"]) == 1 and len(b["output_top_logprobs"]) == 6
    whole = gen(http, input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                logprob_start_len=5).json()["meta_info"]  # fmt: skip
    body = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True,
            "logprob_start_len": 5, "stream": True}  # fmt: skip
    with http.stream("POST", "/generate", json=body) as resp:
        chunks = _events(resp)[:-1]
    last = chunks[-1]["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        got, want = last[key], whole[key]
        assert [e[1] for e in got] == [e[1] for e in want]
        assert all(
            (x[0] is None and y[0] is None) or abs(x[0] - y[0]) < 1e-4 for x, y in zip(got, want)
        )
    lens = [len(c["meta_info"]["output_token_logprobs"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 6  # cumulative, as SGLang streams them


def _events(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_stream_is_sglang_shaped(http):
    text = "streaming is cumulative in sglang"
    whole = gen(http, text=text, sampling_params=GREEDY).json()
    with http.stream("POST", "/generate", json={"text": text, "sampling_params": GREEDY,
                                                "stream": True}) as resp:  # fmt: skip
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for prev, nxt in zip(chunks, chunks[1:]):  # text and ids so far, growing
        assert nxt["text"].startswith(prev["text"])
        assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert nxt["meta_info"]["completion_tokens"] >= prev["meta_info"]["completion_tokens"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert "index" not in last  # only batches carry an index


def test_generate_stream_batch_has_index(http):
    body = {"text": ["a b c", "d e f"], "sampling_params": GREEDY, "stream": True}
    with http.stream("POST", "/generate", json=body) as resp:
        events = _events(resp)
    finals = [e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1]


def test_bench_serving_shaped_request_accepted(http):
    """What SGLang's bench_serving (--backend sglang) and the gateway send, at their defaults."""
    body = {
        "text": "a request as bench_serving sends it",
        "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True, "top_p": 1.0,
            "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "min_new_tokens": 0, "no_stop_trim": False,
            "spaces_between_special_tokens": True, "json_schema": None, "regex": None,
        },
        "stream": False, "return_logprob": False, "logprob_start_len": -1, "lora_path": None,
        "return_hidden_states": False, "top_logprobs_num": 0, "image_data": None,
        "data_parallel_rank": None, "log_metrics": True, "bootstrap_host": None,
    }  # fmt: skip
    r = gen(http, **body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "x", "lora_path": "adapter"}, "lora_path"),
        (
            {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2},
            "logprob_start_len",
        ),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        (
            {"text": ["a", "b"], "return_logprob": True, "logprob_start_len": [0]},
            "logprob_start_len",
        ),
        ({"text": "x", "token_ids_logprob": [1]}, "token_ids_logprob"),
        ({"text": "x", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": "x", "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"text": "x", "sampling_params": {"regex": "a+("}}, "sampling_params.regex"),
        ({"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params"),
        ({"text": "x", "no_such_field": 1}, "no_such_field"),
        ({"text": "x", "input_ids": [1, 2]}, "text"),
        ({}, "text"),
        ({"text": ""}, "text"),
        ({"input_ids": [1, 10**9]}, "prompt"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 10**7}}, None),
        ({"text": ["a", "b"], "rid": "same"}, "rid"),
    ],
)
def test_generate_rejects_unsupported_values(http, body, param):
    r = gen(http, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"]


def test_model_and_server_info(http, engine):
    info = http.get("/get_model_info").json()
    assert http.get("/model_info").json() == info
    assert info["model_path"] == engine.model_name
    assert os.path.isdir(info["tokenizer_path"])
    assert info["is_generation"] is True
    assert info["architectures"] == ["Qwen3NextForCausalLM"]
    assert info["model_type"] == "qwen3_next"
    server = http.get("/get_server_info").json()
    assert http.get("/server_info").status_code == 200
    assert server["served_model_name"] == "tiny-qwen"
    assert server["model_path"] == engine.model_name
    assert server["dp_size"] == 1
    assert server["max_total_num_tokens"] == engine.kv_pool.size
    assert server["page_size"] == engine.config.page_size
    assert "api_key" not in server
    state = server["internal_states"][0]
    assert {"num_running", "cached_tokens", "cache_hit_rate", "cache"} <= set(state)
    assert state["cache"]["kv_pool_size"] == engine.kv_pool.size
    assert http.get("/version").json()["version"]


def test_get_load_and_flush_cache_busy_then_idle(http, server, engine, wait_idle):
    wait_idle()
    idle = http.get("/get_load").json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    gen(http, input_ids=list(range(5, 300)), sampling_params=GREEDY)  # something to cache
    wait_idle()
    assert engine.cache.tree.num_nodes() > 0
    started, checked = threading.Event(), threading.Event()
    body = {"input_ids": list(range(7, 400)), "sampling_params": {
        "max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}, "stream": True}  # fmt: skip

    def long_request() -> None:  # streams until the checks are done, then hangs up (abort)
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            with c.stream("POST", "/generate", json=body) as resp:
                for _ in resp.iter_lines():
                    started.set()
                    if checked.is_set():
                        break

    t = threading.Thread(target=long_request)
    t.start()
    try:
        assert started.wait(60)
        busy_load = http.get("/get_load").json()[0]
        assert busy_load["num_reqs"] >= 1 and busy_load["num_tokens"] > 0
        nodes = engine.cache.tree.num_nodes()
        r = http.post("/flush_cache")
        assert r.status_code == 400 and "not flushed" in r.text
        assert engine.cache.tree.num_nodes() >= nodes  # nothing was freed
    finally:
        checked.set()
        t.join(120)
    wait_idle()
    r = http.get("/flush_cache")  # SGLang accepts GET and POST
    assert r.status_code == 200 and "flushed" in r.text
    assert engine.cache.tree.num_nodes() == 0 and engine.cache.tree.total_kv() == 0
    engine.check_integrity()
    assert http.get("/get_server_info").json()["internal_states"][0]["cache"]["tree_nodes"] == 0
    again = gen(http, input_ids=list(range(5, 300)), sampling_params=GREEDY).json()
    assert again["meta_info"]["cached_tokens"] == 0  # the flushed prefix is gone


def test_tokenize_detokenize(http, engine):
    r = http.post("/tokenize", json={"prompt": "hello world"}).json()
    expected = engine.tokenizer.encode("hello world")
    assert r["tokens"] == expected and r["count"] == len(expected)
    assert r["max_model_len"] == engine.context_length
    batch = http.post("/v1/tokenize", json={"prompt": ["a", "bc d"]}).json()
    assert batch["count"] == [len(t) for t in batch["tokens"]] and len(batch["tokens"]) == 2
    assert http.post("/detokenize", json={"tokens": expected}).json()["text"] == "hello world"
    two = http.post("/v1/detokenize", json={"tokens": batch["tokens"]}).json()["text"]
    assert two == ["a", "bc d"]
    assert http.post("/detokenize", json={"tokens": [10**8]}).status_code == 400
    assert http.post("/tokenize", json={"text": "wrong field"}).status_code == 400


def test_api_key_protects_native_routes(engine):
    cfg = ServerConfig(port=0, api_key="sekrit", served_model_name="tiny-qwen")
    with ServerThread(engine, cfg) as st, httpx.Client(base_url=st.base_url, timeout=60) as c:
        good = {"Authorization": "Bearer sekrit"}
        for method, path, body in [
            ("POST", "/generate", {"text": "x", "sampling_params": GREEDY}),
            ("GET", "/get_model_info", None),
            ("GET", "/get_server_info", None),
            ("GET", "/get_load", None),
            ("POST", "/flush_cache", None),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("GET", "/version", None),
        ]:
            assert c.request(method, path, json=body).status_code == 401, path
            bad = {"Authorization": "Bearer wrong"}
            assert c.request(method, path, json=body, headers=bad).status_code == 401, path
            ok = c.request(method, path, json=body, headers=good)
            assert ok.status_code in (200, 400) and ok.status_code != 401, path
        assert c.get("/health").status_code == 200  # left open, as SGLang does
        assert c.get("/metrics").status_code == 200
        time.sleep(0.05)
