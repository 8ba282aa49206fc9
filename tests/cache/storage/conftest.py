"""Fixtures of the storage-tier tests: a real ``redis-server`` per test (on a port reserved for
the test, no persistence, in a temp dir) and a factory making either backend."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mambaradix.cache.storage.backend import StorageBackend
from mambaradix.server.ports import ReservedPort

INSTALL = "apt-get update -qq && apt-get install -y -qq redis-server"


def ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A ``redis-server`` child process on a port reserved while the object lives (until
    ``close``): ``stop`` and ``start`` keep the port, and no other process takes it between."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.reserved = ReservedPort()
        self.port = self.reserved.port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, wait_s: float = 5.0) -> bool:
        """Start on the reserved port; True once PING answers."""
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # exited
                return False
            if ping(self.port):
                return True
            time.sleep(0.005)
        self.stop()
        return False

    def stop(self) -> None:
        """Kill the server (nothing to save; SIGTERM would cost ~0.1 s of shutdown)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        self.reserved.close()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A running redis-server (``.url``, ``.port``, ``.stop()``, ``.start()``). Fails, never
    skips, where redis-server is not installed."""
    if shutil.which("redis-server") is None:
        pytest.fail(f"redis-server is not installed; install it with: {INSTALL}")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        if not server.start():
            pytest.fail(f"redis-server did not start on port {server.port}")
        yield server
    finally:
        server.close()


@pytest.fixture(params=["file", "redis"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[..., StorageBackend]]:
    """``make_store(capacity_bytes=0)``: a fresh store of the parametrized backend."""
    made: list[StorageBackend] = []
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None

    def make(capacity_bytes: int = 0) -> StorageBackend:
        if server is None:
            from mambaradix.cache.storage.file_backend import FileStorage

            store: StorageBackend = FileStorage(str(tmp_path / "store"), capacity_bytes)
        else:
            from mambaradix.cache.storage.redis_backend import RedisStorage

            store = RedisStorage(server.url, capacity_bytes)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
