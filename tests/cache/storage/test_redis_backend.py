"""The redis backend beyond the shared contract: a server that goes away and comes back, an
unreachable one, namespaces, and a missing client."""

from __future__ import annotations

import logging
import socket
import sys
import time

import pytest

from mambaradix.cache.storage.backend import StorageUsage
from mambaradix.cache.storage.redis_backend import RedisStorage

LOGGER = "mambaradix.cache.storage.redis_backend"


def closed_port() -> socket.socket:
    """A socket bound to a port and never listening: a connection to it is refused for as
    long as the socket is open (no other process can listen there meanwhile)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_server_stopped_and_restarted(redis_server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    store = RedisStorage(redis_server.url, capacity_bytes=10_000, retry_after_s=0.3)
    assert store.put([("before", [b"b" * 10])]) == [True]
    redis_server.stop()

    assert store.put([("k1", [b"v"]), ("k2", [b"w"])]) == [False, False]
    assert store.get(["before", "k1"]) == [None, None]
    assert store.exists(["before"]) == [False]
    store.delete(["before"])
    assert store.usage() == StorageUsage(objects=0, bytes=0)
    assert store.clear() == 0
    assert len(warnings(caplog)) == 1 and redis_server.url in warnings(caplog)[0]

    assert redis_server.start()  # same port; no persistence, so the old object is gone
    assert store.put([("k1", [b"v"])]) == [False], "still backing off: no call to the server"
    time.sleep(0.35)
    assert store.put([("k1", [b"v"])]) == [True]
    assert store.get(["k1", "before"]) == [b"v", None]
    assert store.usage() == StorageUsage(objects=1, bytes=1)
    assert any("works again" in r.getMessage() for r in caplog.records)
    assert len(warnings(caplog)) == 1

    redis_server.stop()  # a second outage after the recovery is logged again
    assert store.get(["k1"]) == [None]
    assert len(warnings(caplog)) == 2


def test_unreachable_server_answers_absent_quickly(caplog):
    with closed_port() as closed:
        store = RedisStorage(f"redis://127.0.0.1:{closed.getsockname()[1]}/0", retry_after_s=60)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert store.put([("k", [b"v"])]) == [False]
            assert store.get(["k"]) == [None] and store.exists(["k"]) == [False]
        assert time.monotonic() - start < 3.0
    assert len(warnings(caplog)) == 1


def test_namespaces_are_separate(redis_server):
    a = RedisStorage(redis_server.url, namespace="tenant-a")
    b = RedisStorage(redis_server.url, namespace="tenant-a2")
    a.put([("k", [b"from-a"]), ("only-a", [b"1"])])
    b.put([("k", [b"from-b"])])
    assert a.get(["k"]) == [b"from-a"] and b.get(["k"]) == [b"from-b"]
    assert a.usage() == StorageUsage(objects=2, bytes=7)
    assert a.clear() == 2
    assert a.get(["k"]) == [None] and b.get(["k"]) == [b"from-b"]
    assert b.usage() == StorageUsage(objects=1, bytes=6)


def test_a_get_counts_as_a_use_only_for_stored_keys(redis_server):
    store = RedisStorage(redis_server.url, namespace="lru")
    store.put([("k", [b"v"])])
    store.get(["k", "missing"])
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    assert raw.zrange("lru:lru", 0, -1) == [b"k"]  # a miss adds no LRU entry
    assert raw.hgetall("lru:size") == {b"k": b"1"} and raw.get("lru:bytes") == b"1"


def test_missing_client_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    with pytest.raises(ImportError, match=r"pip install 'mambaradix\[redis\]'"):
        RedisStorage()
