"""/metrics parses and moves with traffic; --api-key guards /v1 (401 without it)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mambaradix.config import ServerConfig
from mambaradix.server.launch import ServerThread


def _scrape(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            reason = s.labels.get("finish_reason")
            key = s.name + (f"{{{reason}}}" if reason else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def test_metrics_move_with_requests(http, engine, wait_idle) -> None:
    m0 = _scrape(http)
    for name in ("mambaradix:num_running_reqs", "mambaradix:num_queue_reqs",
                 "mambaradix:token_usage", "mambaradix:mamba_usage",
                 "mambaradix:evicted_states_total", "mambaradix:evicted_kv_tokens_total",
                 "mambaradix:num_retracted_requests_total", "mambaradix:skipped_snapshots_total",
                 "mambaradix:state_copies_total", "mambaradix:num_used_tokens",
                 "mambaradix:max_total_num_tokens", "mambaradix:gen_throughput",
                 "mambaradix:cache_hit_rate", "mambaradix:decode_graph_replays_total",
                 "mambaradix:decode_graph_recordings_total",
                 "mambaradix:decode_graph_bytes"):  # fmt: skip
        assert name in m0, name
    prompt = [7] * 40
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5,
                                           "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": -3})
    assert r.status_code == 400
    wait_idle()
    m1 = _scrape(http)
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
    assert d("mambaradix:prompt_tokens_total") == 40
    assert d("mambaradix:generation_tokens_total") == 5
    assert d("mambaradix:cached_tokens_total") == cached
    assert d("mambaradix:time_to_first_token_seconds_count") == 1
    assert d("mambaradix:e2e_request_latency_seconds_count") == 1
    assert d("mambaradix:inter_token_latency_seconds_count") == 4
    assert d("mambaradix:requests_total{length}") == 1
    assert d("mambaradix:requests_total{error}") == 0  # the 400 never reached the engine
    assert d("mambaradix:num_client_errors_total") == 1
    assert d("mambaradix:num_server_errors_total") == 0
    assert d("mambaradix:num_requests_total") == 1
    assert d("mambaradix:queue_time_seconds_count") == 1
    assert d("mambaradix:engine_finished_requests_total") == 1
    assert m1["mambaradix:num_running_reqs"] == 0 and m1["mambaradix:num_queue_reqs"] == 0


@pytest.fixture(scope="module")
def secured(engine):
    cfg = ServerConfig(port=0, api_key="s3cret")
    with ServerThread(engine, cfg) as st:
        yield st


def test_api_key_required(secured, engine) -> None:
    url = secured.base_url
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    r = httpx.post(url + "/v1/completions", json=body, headers=bad)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # probes stay open
    good = {"Authorization": "Bearer s3cret"}
    assert httpx.post(url + "/v1/completions", json=body, headers=good).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    c = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    assert c.completions.create(model=engine.model_name, prompt="hi", max_tokens=2).usage


def test_each_app_has_its_own_registry(secured, server) -> None:
    a = secured.app.state.server.metrics.registry
    b = server.app.state.server.metrics.registry
    assert a is not b
