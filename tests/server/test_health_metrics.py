"""/health and /health_generate tell the truth; metrics carry SGLang's names, model_name on
every series, count aborted streams and keep client errors apart; the seed range is checked
at the API."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mambaradix.config import ServerConfig
from mambaradix.engine.health import HealthReport
from mambaradix.server.launch import ServerThread


def _families(http) -> dict:
    r = http.get("/metrics")
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _value(fams: dict, name: str, **labels) -> float:
    total = 0.0
    for fam in fams.values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_health_and_health_generate(http, engine, wait_idle) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    before = engine.stats().generated_tokens
    r = http.get("/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    wait_idle()
    assert engine.stats().generated_tokens == before + 1  # it really generated a token


def test_health_is_503_when_the_engine_is_dead_or_stuck(http, engine, monkeypatch) -> None:
    for status in ("dead", "stuck"):
        monkeypatch.setattr(engine, "health", lambda s=status: HealthReport(s, f"{s}!"))
        for path in ("/health", "/health_generate"):
            r = http.get(path)
            assert r.status_code == 503 and r.json()["status"] == status, (path, r.text)
    monkeypatch.undo()
    assert http.get("/health").status_code == 200


def test_every_series_has_model_name_and_sglang_names(http) -> None:
    fams = _families(http)
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "max_total_num_tokens",
                 "token_usage", "mamba_usage", "gen_throughput", "cache_hit_rate",
                 "prompt_tokens", "generation_tokens", "cached_tokens", "num_requests",
                 "num_aborted_requests", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "queue_time_seconds", "num_retracted_requests"):  # fmt: skip
        assert "mambaradix:" + name in fams, name
    for fam in fams.values():
        for s in fam.samples:
            assert s.labels.get("model_name") == "tiny-qwen", (s.name, s.labels)


def test_sglang_prefix(engine) -> None:
    with ServerThread(engine, ServerConfig(port=0, metrics_prefix="sglang")) as st:
        text = httpx.get(st.base_url + "/metrics").text
    assert "sglang:num_running_reqs{" in text and "sglang:cache_hit_rate{" in text
    assert "mambaradix:" not in text
    with pytest.raises(ValueError, match="metrics-prefix"):
        ServerConfig(metrics_prefix="bad-prefix").validate()


def test_cache_hit_rate_and_throughput_follow_traffic(http, wait_idle) -> None:
    _families(http)  # the rates cover the time since the previous scrape
    prompt = [9] * 100
    for _ in range(2):  # the second is an exact repeat: a hit
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
    wait_idle()
    fams = _families(http)
    assert 0.3 < _value(fams, "mambaradix:cache_hit_rate") <= 1.0
    assert _value(fams, "mambaradix:gen_throughput") > 0


def test_aborted_stream_is_counted(server, http, engine, wait_idle) -> None:
    wait_idle()
    m0 = _families(http)
    body = {"prompt": [11] * 10, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break
    wait_idle()
    m1 = _families(http)
    d = lambda n, **k: _value(m1, n, **k) - _value(m0, n, **k)  # noqa: E731
    assert d("mambaradix:num_aborted_requests_total") == 1
    assert d("mambaradix:requests_total", finish_reason="abort") == 1
    assert d("mambaradix:num_requests_total") == 1
    assert d("mambaradix:e2e_request_latency_seconds_count") == 1


def test_client_errors_apart_from_engine_errors(http) -> None:
    m0 = _families(http)
    assert http.post("/v1/completions", json={"prompt": "x", "top_p": 7}).status_code == 400
    assert http.post("/v1/nothing", json={}).status_code == 404
    m1 = _families(http)
    d = lambda n, **k: _value(m1, n, **k) - _value(m0, n, **k)  # noqa: E731
    assert d("mambaradix:num_client_errors_total") == 2
    assert d("mambaradix:requests_total", finish_reason="error") == 0
    assert d("mambaradix:num_server_errors_total") == 0


@pytest.mark.parametrize("seed", [18446744073709551616, 1 << 63, -1])
def test_seed_out_of_range_is_a_400_and_the_engine_keeps_serving(http, seed) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200


def test_n_copies_of_the_largest_seed_do_not_overflow(http, engine, wait_idle) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "seed": (1 << 63) - 1, "n": 3, "temperature": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    wait_idle()
    engine.check_integrity()
    assert engine.health().ok
