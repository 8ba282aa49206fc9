"""``/health`` and ``/health_generate``: what a load balancer or supervisor asks.

``/health`` is 200 only while the engine loop is alive and making progress (``Engine.health``:
not dead, no forward running past ``--watchdog-timeout``) and the server is not draining for
shutdown; otherwise 503 with the reason. ``/health_generate`` also runs a one-token generation
through the engine and is 200 only once that token came back.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from mambaradix.core import SamplingParams

DEFAULT_GENERATE_TIMEOUT_S = 300.0


def _state(srv: Any) -> tuple[bool, dict[str, str]]:
    if srv.draining:
        return False, {"status": "draining", "detail": "shutting down: not admitting requests"}
    report = getattr(srv.engine, "health", None)
    if report is None:
        return True, {"status": "ok"}
    report = report()
    if not report.ok:
        return False, {"status": report.status, "detail": report.detail}
    return True, {"status": "ok"}


def add_health_routes(app: FastAPI, srv: Any) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = _state(srv)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        ok, body = _state(srv)
        if not ok:
            return JSONResponse(body, status_code=503)
        engine = srv.engine
        timeout = getattr(getattr(engine, "config", None), "watchdog_timeout", None)
        rid = f"health-{uuid.uuid4().hex[:12]}"
        params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            handle = engine.submit([0], params, rid=rid)
        except Exception as e:  # noqa: BLE001 - the engine refused: not healthy
            return JSONResponse({"status": "error", "detail": str(e)}, status_code=503)
        try:
            out = await asyncio.wait_for(_last(handle), timeout or DEFAULT_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            engine.abort(rid)
            return JSONResponse(
                {"status": "timeout", "detail": "the one-token generation did not finish"},
                status_code=503,
            )
        if out.error is not None or out.completion_tokens < 1:
            return JSONResponse(
                {"status": "error", "detail": out.error or "no token"}, status_code=503
            )
        return JSONResponse({"status": "ok"})


async def _last(handle: Any) -> Any:
    last = None
    async for event in handle.aevents():
        last = event
    return last
