"""The engine on the Redis storage tier, against a real redis-server: a second engine (another
replica, on another machine as far as Redis can tell) resumes what the first stored; the server
stopped in the middle of a run costs hits, never outputs or the engine; started again, hits
come back."""

from __future__ import annotations

import random
import time

import pytest

from mambaradix.engine.engine import Engine

PARAMS = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True, "return_logprob": True}


@pytest.fixture(scope="module")
def tiny():
    from mambaradix.models.loader import load_model, load_tokenizer, resolve_model_path

    path = resolve_model_path("tiny:granite_hybrid")
    return load_model(path), load_tokenizer(path)


def engine(tiny, url: str) -> Engine:
    eng = Engine(
        model=tiny[0], tokenizer=tiny[1], debug_integrity=True, skip_warmup=True,
        enable_hierarchical_cache=True, hicache_storage_backend="redis",
        hicache_storage_url=url, hicache_write_policy="write_through",
        max_total_tokens=1 << 13, disable_overlap_schedule=True,
    )  # fmt: skip
    eng.cache.storage.backend.retry_after_s = 0.2  # come back quickly once Redis does
    return eng


def prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(150)] for _ in range(n)]


def lps(outs) -> list[list[float]]:
    return [o["meta_info"]["output_token_logprobs"] for o in outs]


def close(a, b) -> bool:
    return all(abs(x - y) < 1e-4 for u, v in zip(a, b) for x, y in zip(u, v))


def test_replicas_share_redis_and_survive_an_outage(tiny, redis_server):
    first = prompts(1)
    with engine(tiny, redis_server.url) as a:
        ref = a.generate(input_ids=first, sampling_params=PARAMS)
        assert a.cache.storage.drain(30)
        assert a.stats().storage_objects_written > 0
    with engine(tiny, redis_server.url) as b:  # a fresh process's view: nothing in RAM
        got = b.generate(input_ids=first, sampling_params=PARAMS)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
        assert close(lps(ref), lps(got))
        assert all(o["meta_info"]["cached_tokens_details"]["storage"] >= 128 for o in got)

        redis_server.stop()
        second = prompts(2)
        during = b.generate(input_ids=second, sampling_params=PARAMS)  # serving goes on
        assert all(o["meta_info"]["cached_tokens_details"]["storage"] == 0 for o in during)
        assert b.stats().storage_write_failures > 0
        assert b.health().ok

        assert redis_server.start()
        deadline = time.monotonic() + 30
        seed = 3
        while True:  # writes resume after the back-off
            third = prompts(seed, n=1)
            b.generate(input_ids=third, sampling_params=PARAMS)
            b.cache.storage.drain(10)
            key = b.cache.storage.chain.state_key_at(third[0], 149)
            if b.cache.storage.backend.exists([key])[0]:
                break
            assert time.monotonic() < deadline, "writes did not resume after Redis came back"
            seed += 1
            time.sleep(0.3)
    with engine(tiny, redis_server.url) as c:
        again = c.generate(input_ids=second + third, sampling_params=PARAMS)
        assert [o["output_ids"] for o in again[: len(second)]] == [o["output_ids"] for o in during]
        assert close(lps(during), lps(again[: len(second)]))
        # what was computed while Redis was down is not there; what came after is
        assert again[-1]["meta_info"]["cached_tokens_details"]["storage"] >= 128
