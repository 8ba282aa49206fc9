"""Running the app: blocking (``serve``, the CLI) or in a background thread (``ServerThread``)."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from mambaradix.config import ServerConfig
from mambaradix.server.app import create_app
from mambaradix.server.lifecycle import bind_socket, serve_app

logger = logging.getLogger(__name__)


def serve(engine: Any, cfg: ServerConfig, sock: socket.socket | None = None) -> int:
    """Serve until SIGTERM / SIGINT (drains, returns 0) or the engine's death (returns 1);
    see ``server.lifecycle``. ``sock``: a socket already bound to the address."""
    app = create_app(engine, cfg)
    logger.info("serving %s on http://%s:%d", cfg.served_model_name or engine.model_name,
                cfg.host, cfg.port)  # fmt: skip
    return serve_app(
        app, cfg.host, cfg.port, cfg.log_level, cfg.graceful_shutdown_timeout, sock=sock
    )


class ServerThread:
    """Runs ``create_app(engine, cfg)`` under uvicorn in a daemon thread; port 0 picks a free one
    (bound here, so ``cfg.port`` is the server's from the start).

    Use as a context manager; ``stop()`` shuts uvicorn down (the engine stays the caller's).
    """

    def __init__(self, engine: Any, cfg: ServerConfig | None = None) -> None:
        cfg = dataclasses.replace(cfg) if cfg is not None else ServerConfig(port=0)
        self.sock = bind_socket(cfg.host, cfg.port)
        cfg.port = self.sock.getsockname()[1]
        self.cfg = cfg
        self.app = create_app(engine, cfg)
        config = uvicorn.Config(
            self.app, host=cfg.host, port=cfg.port, log_level="warning", lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="mambaradix-http", daemon=True)  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server did not start on {self.base_url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
