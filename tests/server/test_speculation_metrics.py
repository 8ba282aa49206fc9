"""Speculative decoding as a client sees it: SGLang's ``spec_verify_ct`` and
``spec_accept_length`` in ``meta_info`` of /generate, and the engine's verify steps, the tokens
they emitted, the draft tokens they scored and the mean accept length in /metrics, all equal
to what the engine counted (a server with NGRAM drafts and ``--speculative-adaptive``)."""

from __future__ import annotations

import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mambaradix.config import ServerConfig
from mambaradix.engine.engine import Engine
from mambaradix.server.launch import ServerThread


@pytest.fixture(scope="module")
def served():
    eng = Engine(
        model_path="tiny:lfm2",
        max_total_tokens=8192,
        max_mamba_cache_size=64,
        debug_integrity=True,
        speculative_algorithm="NGRAM",
        speculative_adaptive=True,
    )
    try:
        with ServerThread(eng, ServerConfig(port=0)) as st:
            with httpx.Client(base_url=st.base_url, timeout=60) as http:
                yield eng, http
    finally:
        eng.shutdown()


def _sample(text: str, name: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not in /metrics")


def test_meta_info_and_metrics_count_the_verify_steps(served):
    eng, http = served
    rng = random.Random(0)
    phrase = [rng.randrange(3, 500) for _ in range(6)]
    prompts = [[rng.randrange(3, 500) for _ in range(4)] + phrase * 5 for _ in range(3)]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    r = http.post("/generate", json={"input_ids": prompts, "sampling_params": params})
    assert r.status_code == 200, r.text
    metas = [o["meta_info"] for o in r.json()]
    assert sum(m["spec_verify_ct"] for m in metas) > 0
    for m in metas:
        if m["spec_verify_ct"]:
            assert 1.0 <= m["spec_accept_length"] <= 4.0
    stats = eng.stats()
    text = http.get("/metrics").text
    assert _sample(text, "mambaradix:spec_verify_ct_total") == stats.spec_verify_ct > 0
    assert _sample(text, "mambaradix:spec_accepted_tokens_total") == stats.spec_accepted_tokens
    assert _sample(text, "mambaradix:spec_draft_tokens_total") == stats.spec_draft_tokens > 0
    assert _sample(text, "mambaradix:spec_accept_length") == pytest.approx(
        stats.spec_accepted_tokens / stats.spec_verify_ct
    )
    # every verify scored at least one draft token and emitted at most one more than it scored
    assert stats.spec_verify_ct <= stats.spec_draft_tokens
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens + stats.spec_verify_ct
