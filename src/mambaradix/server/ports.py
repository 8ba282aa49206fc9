"""Local ports for servers another process starts, without the race of "find a free port, let
the server bind it later".

A port found free by binding port 0 and closing the socket is anyone's until the server binds
it: another test, replica or gateway can take it meanwhile, and the server then fails to
start. ``ReservedPort`` keeps that socket bound instead (``SO_REUSEADDR``, never listening).
On Linux a bound port is handed to no other bind of port 0 and to no outgoing connection,
while a server that binds it by number with ``SO_REUSEADDR`` still gets it (``bind_socket``
of ``server.lifecycle``, uvicorn, sglang-router, redis-server all set it); only one socket
can listen on it, so the reservation never takes the server's connections. Held across a
server's restarts, it keeps the port for the restart. Elsewhere (BSD rules: a second bind of
the same address fails even with ``SO_REUSEADDR``) the socket is closed at once, as before.
"""

from __future__ import annotations

import socket
import sys

HOLDS = sys.platform.startswith("linux")


class ReservedPort:
    """A free port on ``host``, held until ``close()`` (or the end of a ``with`` block)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.host = host
        self.port: int = sock.getsockname()[1]
        self._sock: socket.socket | None = sock
        if not HOLDS:
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> ReservedPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ReservedPort({self.host}:{self.port})"
