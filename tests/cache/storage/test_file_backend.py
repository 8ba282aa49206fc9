"""The file backend beyond the shared contract: atomic writes (a failed or concurrent write is
never visible in part), stale temp files, a full disk, and a directory shared by processes."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time

from mambaradix.cache.storage import file_backend
from mambaradix.cache.storage.backend import StorageUsage
from mambaradix.cache.storage.file_backend import FileStorage

LOGGER = "mambaradix.cache.storage.file_backend"


def files_under(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )


def test_layout_is_objects_by_two_char_prefix(tmp_path):
    store = FileStorage(str(tmp_path))
    store.put([("ab12-x", [b"1"]), ("z", [b"2"])])
    assert files_under(tmp_path) == ["objects/ab/ab12-x", "objects/z/z"]
    assert (tmp_path / "tmp").is_dir()


def test_write_failing_midway_leaves_no_object_and_no_temp_file(tmp_path, monkeypatch):
    store = FileStorage(str(tmp_path), retry_after_s=0.0)
    assert store.put([("key", [b"old" * 10])]) == [True]
    real_write = os.write
    calls = []

    def half_then_fail(fd, data):
        calls.append(len(data))
        if len(calls) == 1:  # a short write, then the device fails
            return real_write(fd, memoryview(data)[: len(data) // 2])
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(os, "write", half_then_fail)
        assert store.put([("key", [b"n" * 1000, b"m" * 1000])]) == [False]
        calls.clear()
        assert store.put([("new", [b"n" * 1000])]) == [False]
    assert len(calls) == 2, "the write did fail midway"
    assert store.get(["key", "new"]) == [b"old" * 10, None]
    assert store.exists(["new"]) == [False]
    assert files_under(tmp_path) == ["objects/ke/key"]  # no temp file, no partial object
    assert store.usage() == StorageUsage(objects=1, bytes=30)


def test_stale_temp_files_are_removed_at_start(tmp_path):
    FileStorage(str(tmp_path))
    host = file_backend._host_tag()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    names = {
        "dead-writer": f"{host}_{dead.pid}_aa.tmp",
        "live-fresh": f"{host}_{live}_bb.tmp",
        "live-old": f"{host}_{live}_cc.tmp",
        "other-host-fresh": f"elsewhere_{dead.pid}_dd.tmp",
        "other-host-old": f"elsewhere_{dead.pid}_ee.tmp",
        "unnamed-old": "junk.tmp",
    }
    for name in names.values():
        (tmp_path / "tmp" / name).write_bytes(b"partial")
    old = time.time() - 120
    for which in ("live-old", "other-host-old", "unnamed-old"):
        os.utime(tmp_path / "tmp" / names[which], (old, old))
    store = FileStorage(str(tmp_path))
    kept = sorted(os.listdir(tmp_path / "tmp"))
    assert kept == sorted([names["live-fresh"], names["other-host-fresh"]])
    assert store.usage() == StorageUsage(objects=0, bytes=0)  # temp files are never objects


WRITER = """
import os, sys
from mambaradix.cache.storage.file_backend import FileStorage
root, fill, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = FileStorage(root)
parts = [bytes([fill]) * 65536 for _ in range(4)]
print("ready", flush=True)
n = 0
while not os.path.exists(stop) and n < 20000:
    assert store.put([("same-key", parts)]) == [True]
    n += 1
print(n, flush=True)
"""


def test_concurrent_writers_of_one_key_never_show_a_partial_object(tmp_path):
    root, stop = str(tmp_path / "store"), str(tmp_path / "stop")
    FileStorage(root)
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, root, str(fill), stop],
            stdout=subprocess.PIPE,
            text=True,
        )
        for fill in (1, 2)
    ]
    complete = {bytes([1]) * 262144: "a", bytes([2]) * 262144: "b"}
    try:
        for w in writers:
            assert w.stdout.readline().strip() == "ready"
        reader = FileStorage(root)
        seen = {"none": 0, "a": 0, "b": 0}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            (data,) = reader.get(["same-key"])
            if data is None:
                seen["none"] += 1
                continue
            assert data in complete, f"a read saw {len(data)} bytes that are no whole object"
            seen[complete[data]] += 1
    finally:
        open(stop, "w").close()
        counts = [w.communicate(timeout=30)[0].split()[-1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0]
    assert all(int(c) > 0 for c in counts)
    assert seen["a"] > 0 and seen["b"] > 0, f"reads did not overlap both writers: {seen}"
    assert os.listdir(tmp_path / "store" / "tmp") == []


def test_full_disk_logs_once_backs_off_and_keeps_reading(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    store = FileStorage(str(tmp_path), retry_after_s=0.3)
    assert store.put([("keep", [b"kept"])]) == [True]
    attempts = []

    def full(fd, data):
        attempts.append(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        assert store.put([("a1", [b"x"]), ("a2", [b"y"])]) == [False, False]
        assert store.put([("a3", [b"z"])]) == [False]
    assert len(attempts) == 1, "the batch's second object and the next put were skipped"
    assert len(warnings()) == 1 and "No space left on device" in warnings()[0]
    assert "skipping writes" in warnings()[0]
    # during the back-off writes are skipped even though the disk works; reads go on
    assert store.put([("a4", [b"w"])]) == [False] and store.exists(["a4"]) == [False]
    assert store.get(["keep", "a1"]) == [b"kept", None]
    assert os.listdir(tmp_path / "tmp") == []
    assert store.usage() == StorageUsage(objects=1, bytes=4)

    time.sleep(0.35)  # back-off over, still full: tried again, not logged again
    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        assert store.put([("a5", [b"v"])]) == [False]
    assert len(attempts) == 2 and len(warnings()) == 1

    time.sleep(0.35)  # a success, then a new failure is logged again
    assert store.put([("a6", [b"u"])]) == [True]
    assert any("succeed again" in r.getMessage() for r in caplog.records)
    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        assert store.put([("a7", [b"t"])]) == [False]
    assert len(warnings()) == 2


def test_processes_share_usage_and_lru_order(tmp_path):
    root = str(tmp_path)
    writer = FileStorage(root)
    for i in range(5):
        writer.put([(f"k{i}", [b"x" * 100])])
        time.sleep(0.002)
    other = FileStorage(root, capacity_bytes=600)
    assert other.usage() == StorageUsage(objects=5, bytes=500)  # its first scan sees them
    assert other.get(["k0"]) == [b"x" * 100]  # a use, seen by every process through mtime
    time.sleep(0.002)
    other.put([("k5", [b"x" * 100])])
    time.sleep(0.002)
    other.put([("k6", [b"x" * 100])])  # 700 > 600: down to at most 540
    assert writer.exists([f"k{i}" for i in range(7)]) == [
        True,
        False,
        False,
        True,
        True,
        True,
        True,
    ]
    assert other.usage() == StorageUsage(objects=5, bytes=500)


def test_unreadable_object_is_a_miss_logged_once(tmp_path, caplog):
    store = FileStorage(str(tmp_path))
    store.put([("ok", [b"fine"])])
    (tmp_path / "objects" / "di").mkdir()
    (tmp_path / "objects" / "di" / "dir").mkdir()  # open() of a directory: IsADirectoryError
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(["dir", "ok", "dir"]) == [None, b"fine", None]
        assert store.get(["dir"]) == [None]
    assert sum("treated as a miss" in r.getMessage() for r in caplog.records) == 2
