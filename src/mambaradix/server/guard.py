"""HTTP-level guards of the app: the request body's size limit (413) and the middleware that
turns an unhandled exception into a well-formed 500."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request

from mambaradix.server.protocol import APIError, error_body

logger = logging.getLogger(__name__)


class ServerErrorGuard:
    """ASGI middleware: an exception no route handled becomes a complete 500 JSON response,
    logged once; after the response started, the body is ended properly instead. Either way
    the HTTP/1.1 framing stays intact and the client can reuse the connection."""

    def __init__(self, app: Any, on_error: Any = None) -> None:
        self.app = app
        self.on_error = on_error  # called with the status of each 500 (the metrics count it)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False}

        async def guarded_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        except Exception as exc:
            logger.exception("internal error while serving %s", scope.get("path"))
            if self.on_error is not None:
                self.on_error(500)
            if state["ended"]:
                return
            if state["started"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            body = json.dumps(
                error_body(f"internal server error: {exc}", type="server_error")
            ).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes ``limit`` bytes (--max-body-mb; the rest is read and
    dropped, so the connection stays usable)."""
    declared = request.headers.get("content-length")
    too_big = declared is not None and declared.isdigit() and int(declared) > limit
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_big = True
        if not too_big:
            parts.append(chunk)
    if too_big:
        raise APIError(
            f"the request body is larger than the server's limit of {limit} bytes (--max-body-mb)",
            status=413,
            code="request_too_large",
        )
    return b"".join(parts)
