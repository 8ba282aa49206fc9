"""The storage backend contract (``cache.storage.backend``), run on both backends: the file
store in a temp dir and the redis store on a real server."""

from __future__ import annotations

import time

import pytest

from mambaradix.cache.storage.backend import StorageUsage, create_storage_backend
from mambaradix.cache.storage.file_backend import FileStorage
from mambaradix.cache.storage.redis_backend import RedisStorage


def test_round_trip_of_multi_part_objects(make_store):
    store = make_store()
    parts = [b"head", memoryview(b"-tensor-a-"), bytearray(b"tensor-b"), memoryview(b"")]
    assert store.put([("k-1", parts), ("k-2", [b"x" * 10_000, b"y"]), ("empty", [])]) == [
        True,
        True,
        True,
    ]
    assert store.get(["k-1", "k-2", "empty"]) == [
        b"head-tensor-a-tensor-b",
        b"x" * 10_000 + b"y",
        b"",
    ]
    assert store.exists(["k-1", "k-2", "empty"]) == [True, True, True]
    store.delete(["k-1", "never-stored"])
    assert store.get(["k-1", "k-2"]) == [None, b"x" * 10_000 + b"y"]
    assert store.exists(["k-1", "k-2"]) == [False, True]


def test_batches_with_absent_keys(make_store):
    store = make_store()
    assert store.put([("a1", [b"one"]), ("c3", [b"three"])]) == [True, True]
    assert store.get(["a1", "b2", "c3", "d4"]) == [b"one", None, b"three", None]
    assert store.exists(["zz", "a1", "b2", "c3"]) == [False, True, False, True]
    assert store.get([]) == [] and store.exists([]) == [] and store.put([]) == []


def test_overwrite_replaces_the_object_and_its_size(make_store):
    store = make_store()
    store.put([("key", [b"a" * 100])])
    assert store.put([("key", [b"b" * 30, b"c" * 10])]) == [True]
    assert store.get(["key"]) == [b"b" * 30 + b"c" * 10]
    assert store.usage() == StorageUsage(objects=1, bytes=40)


def test_usage_counts_puts_and_deletes(make_store):
    store = make_store()
    assert store.usage() == StorageUsage(objects=0, bytes=0)
    store.put([(f"o{i}", [b"z" * (10 * i + 1)]) for i in range(5)])
    assert store.usage() == StorageUsage(objects=5, bytes=sum(10 * i + 1 for i in range(5)))
    store.delete(["o0", "o4", "absent"])
    assert store.usage() == StorageUsage(objects=3, bytes=11 + 21 + 31)


def test_clear_removes_everything_and_the_store_stays_usable(make_store):
    store = make_store()
    store.put([(f"c{i}", [b"v" * 7]) for i in range(4)])
    assert store.clear() == 4
    assert store.get([f"c{i}" for i in range(4)]) == [None] * 4
    assert store.usage() == StorageUsage(objects=0, bytes=0)
    assert store.clear() == 0
    assert store.put([("c0", [b"again"])]) == [True] and store.get(["c0"]) == [b"again"]


def test_capacity_evicts_least_recently_used(make_store):
    store = make_store(capacity_bytes=1000)
    for i in range(9):  # 900 bytes: under capacity
        assert store.put([(f"k{i:02d}", [b"x" * 100])]) == [True]
        time.sleep(0.002)
    assert store.get(["k00"]) == [b"x" * 100]  # k00 is now the most recently used
    time.sleep(0.002)
    store.put([("k09", [b"x" * 100])])  # exactly at capacity: nothing removed
    assert all(store.exists([f"k{i:02d}" for i in range(10)]))
    time.sleep(0.002)
    store.put([("k10", [b"x" * 100])])  # over: the oldest go until at most 90% is left
    assert store.exists(["k00", "k01", "k02"]) == [True, False, False]
    assert all(store.exists([f"k{i:02d}" for i in range(3, 11)]))
    assert store.usage() == StorageUsage(objects=9, bytes=900)


def test_capacity_bounds_the_total_under_churn(make_store):
    store = make_store(capacity_bytes=2000)
    hot = "hot"
    store.put([(hot, [b"h" * 150])])
    for i in range(40):
        time.sleep(0.001)
        assert store.get([hot]) == [b"h" * 150], f"the hot object was evicted at put {i}"
        time.sleep(0.001)
        assert store.put([(f"cold-{i}", [b"c" * (50 + 7 * i)])]) == [True]
        used = store.usage()
        assert used.bytes <= 2000, f"{used} over capacity after put {i}"
    assert store.exists(["cold-0", "cold-39"]) == [False, True]


@pytest.mark.parametrize(
    "key", ["", "A", "a/b", "../x", "a.b", "a b", "é", "x" * 129, "k\n", None, 7]
)
def test_bad_keys_are_rejected(make_store, key):
    store = make_store()
    with pytest.raises(ValueError, match="bad storage key"):
        store.put([(key, [b"v"])])
    with pytest.raises(ValueError, match="bad storage key"):
        store.get(["ok", key])
    with pytest.raises(ValueError, match="bad storage key"):
        store.exists([key])
    with pytest.raises(ValueError, match="bad storage key"):
        store.delete([key])
    assert store.usage().objects == 0  # nothing was written before the check


def test_longest_key_is_accepted(make_store):
    store = make_store()
    key = "0-" + "z" * 126
    assert store.put([(key, [b"v"])]) == [True] and store.get([key]) == [b"v"]


def test_registry_creates_both_backends(tmp_path, redis_server):
    file_store = create_storage_backend("file", root=str(tmp_path), capacity_bytes=5)
    assert isinstance(file_store, FileStorage) and file_store.capacity_bytes == 5
    redis_store = create_storage_backend("redis", url=redis_server.url, namespace="ns")
    assert isinstance(redis_store, RedisStorage) and redis_store.put([("k", [b"v"])]) == [True]
    with pytest.raises(ValueError, match="unknown --hicache-storage-backend"):
        create_storage_backend("tape")
