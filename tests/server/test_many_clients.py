"""Many HTTP clients at once, a third of them leaving mid-stream: the others get the same
tokens as when each is served alone, every aborted request frees its slots, and the engine
ends idle with every slot, request and lock accounted for (checked after every step)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

N_CLIENTS = 30
NEW_TOKENS = 12


def _bodies(vocab: int) -> list[dict]:
    rng = random.Random(21)
    system = [rng.randrange(3, vocab) for _ in range(140)]
    bodies = []
    for i in range(N_CLIENTS):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 40))]
        prompt = (system if i % 3 else []) + tail
        leaves = i % 3 == 1
        bodies.append(
            {
                "prompt": prompt,
                # a leaving client asks for far more than it waits for
                "max_tokens": 400 if leaves else NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "leaves": leaves,
            }
        )
    return bodies


async def _client(c: httpx.AsyncClient, body: dict) -> list[str] | None:
    send = {k: v for k, v in body.items() if k != "leaves"}
    pieces: list[str] = []
    async with c.stream("POST", "/v1/completions", json=send) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            pieces.append(json.loads(line[5:])["choices"][0]["text"])
            if body["leaves"] and len(pieces) >= 3:
                return None  # closes the connection mid-stream
    return pieces


async def _all(base_url: str, bodies: list[dict]) -> list[list[str] | None]:
    limits = httpx.Limits(max_connections=N_CLIENTS)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as c:
        return await asyncio.gather(*(_client(c, b) for b in bodies))


def test_many_streams_with_disconnects(server, engine, http, wait_idle) -> None:
    wait_idle()
    before = engine.stats()
    bodies = _bodies(len(engine.tokenizer))
    results = asyncio.run(_all(server.base_url, bodies))
    wait_idle(timeout=60)
    after = engine.stats()
    assert after.finished_requests - before.finished_requests == N_CLIENTS
    left = [b for b in bodies if b["leaves"]]
    generated = after.generated_tokens - before.generated_tokens
    stayed = N_CLIENTS - len(left)
    assert generated < stayed * NEW_TOKENS + len(left) * 400  # the leavers were aborted
    engine.check_integrity()
    for body, got in zip(bodies, results):
        if body["leaves"]:
            assert got is None
            continue
        alone = http.post(
            "/v1/completions",
            json={k: v for k, v in body.items() if k not in ("leaves", "stream")},
        ).json()
        assert "".join(got) == alone["choices"][0]["text"]
    wait_idle()
    engine.check_integrity()
