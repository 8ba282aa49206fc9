"""The storage tier over HTTP: SGLang's native ``/generate`` reports ``cached_tokens_details``
per tier; ``/flush_cache`` empties only RAM, so the same prompt then hits from storage;
``/hicache/storage-backend/clear`` (and SGLang's older ``/clear_hicache_storage_backend``)
empties storage; ``/metrics`` counts storage hits. Without the tier the clear call is a 400."""

from __future__ import annotations

import httpx

from mambaradix.config import ServerConfig
from mambaradix.engine.engine import Engine
from mambaradix.server.launch import ServerThread


def test_flush_keeps_storage_and_clear_empties_it(tmp_path, http):
    prompt = list(range(5, 205))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    with Engine(
        model_path="tiny:qwen3_next", skip_warmup=True, enable_hierarchical_cache=True,
        hicache_storage_dir=str(tmp_path), max_total_tokens=8192, debug_integrity=True,
    ) as eng, ServerThread(eng, ServerConfig(port=0)) as st:  # fmt: skip
        with httpx.Client(base_url=st.base_url, timeout=60) as c:
            first = c.post("/generate", json=body).json()
            assert first["meta_info"]["cached_tokens_details"] == {"device": 0, "storage": 0}
            assert c.post("/flush_cache").status_code == 200  # write_back: demoted to storage
            assert eng.cache.storage.drain(30)
            again = c.post("/generate", json=body).json()
            assert again["output_ids"] == first["output_ids"]
            details = again["meta_info"]["cached_tokens_details"]
            assert details["storage"] == again["meta_info"]["cached_tokens"] >= 192
            metrics = c.get("/metrics").text
            assert "mambaradix:storage_hit_tokens" in metrics
            hits = [ln for ln in metrics.splitlines() if ln.startswith("mambaradix:storage_hit")]
            assert float(hits[-1].split()[-1]) >= 192

            eng.cache.storage.drain(30)
            assert any((tmp_path / "objects").rglob("st-*"))
            cleared = c.post("/hicache/storage-backend/clear")
            assert cleared.status_code == 200
            assert cleared.json() == "Hierarchical cache storage backend cleared."
            assert not any((tmp_path / "objects").rglob("*-*"))
            assert c.get("/clear_hicache_storage_backend").status_code == 200
            assert c.post("/flush_cache").status_code == 200
            third = c.post("/generate", json=body).json()
            assert third["meta_info"]["cached_tokens"] == 0  # nothing left in either tier
            assert third["output_ids"] == first["output_ids"]
    # the shared server of this directory runs without the tier
    r = http.post("/hicache/storage-backend/clear")
    assert r.status_code == 400 and "not enabled" in r.text
