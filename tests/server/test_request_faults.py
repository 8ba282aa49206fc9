"""A fault while handling one HTTP request fails it alone (a 500 with the reason, or an SSE
error event and [DONE]); the server and engine keep serving; long inputs are tokenized off the
event loop."""

from __future__ import annotations

import json
import threading

from mambaradix.engine import runner as runner_mod

MARK_SEED = 424242


def _patch_sampler(monkeypatch) -> None:
    real = runner_mod.sample

    def sample(logits, params, gens, states=None, constrain=None):
        if any(p.seed == MARK_SEED for p in params):
            raise RuntimeError("injected sampler fault")
        return real(logits, params, gens, states, constrain)

    monkeypatch.setattr(runner_mod, "sample", sample)


def test_one_failing_request_gets_a_500_the_rest_are_served(http, engine, wait_idle,
                                                            monkeypatch) -> None:  # fmt: skip
    _patch_sampler(monkeypatch)
    bad = {"prompt": "hello", "max_tokens": 4, "seed": MARK_SEED, "temperature": 0.5}
    r = http.post("/v1/completions", json=bad)
    assert r.status_code == 500 and "injected sampler fault" in r.json()["error"]["message"]
    good = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                              "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as s:
        events = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "injected sampler fault" in json.loads(events[-2])["error"]["message"]
    wait_idle()
    engine.check_integrity()
    assert http.get("/health").status_code == 200


def test_long_prompts_are_tokenized_off_the_event_loop(http, engine, monkeypatch) -> None:
    tok = engine.tokenizer
    seen: list[str] = []
    real_encode = tok.encode

    def encode(*a, **k):
        seen.append(threading.current_thread().name)
        return real_encode(*a, **k)

    monkeypatch.setattr(tok, "encode", encode)
    body = {"max_tokens": 1, "temperature": 0}
    # long enough to be tokenized in a worker (the context check may then refuse it)
    http.post("/v1/completions", json={**body, "prompt": "ab " * 3000})
    chat = {**body, "messages": [{"role": "user", "content": "ab " * 3000}]}
    http.post("/v1/chat/completions", json=chat)
    assert http.post("/v1/completions", json={**body, "prompt": "short"}).status_code == 200
    loop_thread = seen[-1]  # the short prompt: inline, on the event loop's thread
    assert len(seen) == 3 and seen[0] != loop_thread and seen[1] != loop_thread, seen
