"""``ReservedPort``: a port held for a server another process binds later. While held, the
server binds and listens on it (``SO_REUSEADDR``, as ``bind_socket`` sets), again after a
restart; a bind that does not ask to share it is refused (the port is really taken); closed,
the port is anyone's."""

from __future__ import annotations

import errno
import socket

import pytest

from mambaradix.server import ports
from mambaradix.server.lifecycle import bind_socket
from mambaradix.server.ports import ReservedPort

pytestmark = pytest.mark.skipif(not ports.HOLDS, reason="held only on Linux")


def plain_bind(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    return s


def serve_once(port: int) -> None:
    """A server binds ``port`` as ``mambaradix serve`` does, accepts one connection, exits."""
    with bind_socket("127.0.0.1", port) as server:
        server.listen()
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, _ = server.accept()
        client.close()  # the client closes first: TIME_WAIT on its port, not on the server's
        assert conn.recv(1) == b""
        conn.close()


def test_a_server_binds_the_reserved_port_and_again_after_a_restart():
    with ReservedPort() as reserved:
        serve_once(reserved.port)
        serve_once(reserved.port)  # restarted on the port the reservation kept
        with pytest.raises(OSError) as e:  # negative control: nobody else gets it meanwhile
            plain_bind(reserved.port)
        assert e.value.errno == errno.EADDRINUSE
        with pytest.raises(ConnectionRefusedError):  # the reservation itself takes no calls
            socket.create_connection(("127.0.0.1", reserved.port), timeout=5)
    plain_bind(reserved.port).close()  # released
