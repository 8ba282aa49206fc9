"""A client that goes away mid-request gets its request aborted and its slots freed."""

from __future__ import annotations

import httpx
import pytest


def _long_body(engine, stream: bool) -> dict:
    prompt = [11] * 20
    return {
        "prompt": prompt,
        "max_tokens": engine.context_length - len(prompt),  # far more than the test waits for
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def test_stream_disconnect_aborts(server, engine, wait_idle) -> None:
    wait_idle()
    before = engine.stats()
    body = _long_body(engine, stream=True)
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got += 1
                if got >= 3:
                    break  # leave with the response unread: the connection closes
    wait_idle(timeout=20)
    after = engine.stats()
    assert after.finished_requests == before.finished_requests + 1
    generated = after.generated_tokens - before.generated_tokens
    assert 3 <= generated < body["max_tokens"]  # stopped early: aborted, not completed
    engine.check_integrity()  # every KV / state slot is free or in the tree


def test_non_streaming_disconnect_aborts(server, engine, wait_idle) -> None:
    wait_idle()
    before = engine.stats()
    body = _long_body(engine, stream=False)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.0)
    wait_idle(timeout=20)
    after = engine.stats()
    assert after.finished_requests == before.finished_requests + 1
    assert after.generated_tokens - before.generated_tokens < body["max_tokens"]
    engine.check_integrity()
