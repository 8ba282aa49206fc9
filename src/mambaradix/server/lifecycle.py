"""The life of a serving process: bind, serve, drain on SIGTERM, exit non-zero when the engine
dies.

- ``bind_socket`` binds the port before the model loads, so a port in use is one clear error
  at once rather than after minutes of loading.
- ``ManagedServer`` (a uvicorn server): the first SIGTERM / SIGINT stops admission (new
  requests and ``/health`` get 503), lets the requests being served finish for
  ``--graceful-shutdown-timeout`` seconds, then aborts the rest in the engine (each stream gets
  a final ``finish_reason: "abort"`` event and ``[DONE]``) and exits 0. A second signal exits
  at once. A supervisor thread watches ``engine.health()``: when the engine dies, the process
  stops serving and ``serve`` returns 1, so a supervisor (or the ``--dp-size`` launcher)
  restarts it.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

POLL_S = 0.1
ABORT_GRACE_S = 5.0  # after the abort: how long the aborted streams get to send their last event


class PortInUseError(OSError):
    """The address to serve on is taken."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket bound to ``host:port``; ``PortInUseError`` if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUseError(
                e.errno, f"port {port} on {host} is already in use; pick another with --port"
            ) from None
        raise PortInUseError(e.errno, f"cannot bind {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


class ManagedServer(uvicorn.Server):
    """uvicorn with graceful shutdown and an engine-death watch; ``exit_code`` after ``run``."""

    def __init__(self, config: uvicorn.Config, srv: Any, grace_s: float) -> None:
        super().__init__(config)
        self.srv = srv
        self.grace_s = grace_s
        self.exit_code = 0
        self._signalled = threading.Event()
        self._supervisor = threading.Thread(
            target=self._supervise, name="mambaradix-supervisor", daemon=True
        )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signalled.is_set():  # a second signal: stop now
            logger.warning("second signal: exiting without waiting for running requests")
            self.should_exit = True
            self.force_exit = True
            return
        logger.info(
            "received %s: draining (up to %g s for running requests)",
            signal.Signals(sig).name,
            self.grace_s,
        )
        self.srv.draining = True
        self._signalled.set()

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        self._supervisor.start()
        super().run(sockets=sockets)

    def _supervise(self) -> None:
        engine = self.srv.engine
        while not self.should_exit:
            if self._signalled.wait(POLL_S):
                self._drain()
                return
            report = engine.health()
            if report.status == "dead":
                logger.error("the engine is dead (%s); stopping the server", report.detail)
                self.exit_code = 1
                self.srv.draining = True
                self._wait_idle(ABORT_GRACE_S)  # the failed requests' error events go out
                self.should_exit = True
                return

    def _drain(self) -> None:
        if not self._wait_idle(self.grace_s):
            logger.warning(
                "graceful shutdown: %d request(s) still running after %g s; aborting them",
                self.srv.active,
                self.grace_s,
            )
            self.srv.engine.abort_all()
            self._wait_idle(ABORT_GRACE_S)
        self.should_exit = True

    def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.srv.active > 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S / 2)
        return True


def serve_app(app: Any, host: str, port: int, log_level: str, grace_s: float,
              sock: socket.socket | None = None) -> int:  # fmt: skip
    """Serve ``app`` until a signal (exit 0 after draining) or the engine's death (1)."""
    sock = sock or bind_socket(host, port)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=int(ABORT_GRACE_S),  # backstop for a connection that hangs
    )
    server = ManagedServer(config, app.state.server, grace_s)
    server.run(sockets=[sock])
    return server.exit_code
