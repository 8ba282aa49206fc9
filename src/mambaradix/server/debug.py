"""Debug routes, served only with ``--enable-debug-endpoints`` (``create_app`` leaves them out
otherwise, so they answer 404), behind ``--api-key`` like the native routes:

- ``GET /debug/tree?format=mermaid|dot&max_nodes=N``: the radix tree as text/plain Mermaid or
  DOT (``Engine.cache_tree``, ``cache.tree_view``); a bad ``format`` or ``max_nodes`` is a 400
  naming the parameter, and so is a server whose cache is disabled (there is no tree).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from mambaradix.server.native import keyed_router
from mambaradix.server.protocol import APIError

MAX_NODES_LIMIT = 10_000  # the most nodes one picture may ask for


def debug_router(srv: Any) -> APIRouter:
    """The debug routes over the app's shared state ``srv`` (``app._Server``)."""
    engine = srv.engine

    router = keyed_router(srv)

    @router.get("/debug/tree")
    async def tree(format: str = "mermaid", max_nodes: str = "200") -> PlainTextResponse:
        if format not in ("mermaid", "dot"):
            raise APIError(f"format must be 'mermaid' or 'dot', got {format!r}", param="format")
        try:
            bound = int(max_nodes)
        except ValueError:
            bound = 0
        if not 1 <= bound <= MAX_NODES_LIMIT:
            raise APIError(
                f"max_nodes must be an integer in [1, {MAX_NODES_LIMIT}], got {max_nodes!r}",
                param="max_nodes",
            )
        try:
            text = await asyncio.to_thread(engine.cache_tree, format, bound)
        except ValueError as e:  # the cache is disabled
            raise APIError(str(e)) from None
        return PlainTextResponse(text)

    return router
