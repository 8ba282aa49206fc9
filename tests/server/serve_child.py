"""``mambaradix serve`` in a child process, optionally with an injected engine fault: a
forward whose batch holds a prompt starting with FAULT_PROMPT raises (a fault of the engine
itself, not of one request). Run as ``python serve_child.py [--fault] [--listen-fd FD] <serve
flags>``: with ``--listen-fd`` the server takes the socket the test bound (port 0, inherited
as FD) instead of binding ``--port`` itself, so no other process can take the port between
the test choosing it and the server binding it."""

from __future__ import annotations

import socket
import sys

FAULT_PROMPT = [13, 17, 13, 17, 13]


def main() -> int:
    args = sys.argv[1:]
    if args and args[0] == "--fault":
        args = args[1:]
        from mambaradix.engine import runner

        real = runner.ModelRunner.run

        def run(self, batch):
            if any(r.input_ids[:5] == FAULT_PROMPT for r in batch.forward.reqs):
                raise RuntimeError("injected forward fault")
            return real(self, batch)

        runner.ModelRunner.run = run
    if args and args[0] == "--listen-fd":
        fd, args = int(args[1]), args[2:]
        from mambaradix.server import lifecycle

        def inherited(host: str, port: int) -> socket.socket:
            sock = socket.socket(fileno=fd)
            assert sock.getsockname()[1] == port, (sock.getsockname(), port)
            return sock

        lifecycle.bind_socket = inherited  # cli's serve looks it up when it runs
    from mambaradix.cli import main as cli_main

    return cli_main(["serve", *args])


if __name__ == "__main__":
    sys.exit(main())
