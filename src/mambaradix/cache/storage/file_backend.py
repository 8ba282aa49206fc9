"""The ``file`` storage backend: one object per file under a directory that several processes
(and machines mounting it) may share.

::

    root/objects/<key[:2]>/<key>      complete objects, only ever made by rename
    root/tmp/<host>_<pid>_<random>.tmp   objects being written (never visible as objects)

Atomicity: an object is written whole to a temp file, fsynced, then renamed into place, so a
reader (in any process) opens either the old complete file, the new one, or nothing. A process
killed mid-write leaves only a temp file, removed by the next ``FileStorage`` started on the
directory once its writer is gone or it is over a minute old.

LRU across processes: a ``get`` sets the file's mtime to now, so the modification time of every
object is the time of its last put or get, whichever process made it; eviction removes the
oldest mtimes first.

Usage is a running total kept by this process, initialised by one scan of the directory (at
the first ``put`` or ``usage``) and adjusted by this process's own puts and deletes; writes by
other processes are not seen until the next scan, which happens whenever the total goes over
capacity (eviction scans anyway). So ``usage`` is exact for a single process and an estimate
for a shared directory.

Availability: a failed write (ENOSPC, EIO, permissions, a vanished mount) is logged once, the
put answers False and writes are skipped for ``retry_after_s`` seconds (serving goes on from
RAM); the warning is repeated only after a write has succeeded in between. A failed read is a
miss.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Sequence

from mambaradix.cache.storage.backend import (
    Buffer,
    StorageBackend,
    StorageUsage,
    register_storage_backend,
)

logger = logging.getLogger(__name__)

_KEY = re.compile(r"[0-9a-z-]{1,128}")
STALE_TEMP_S = 60.0
EVICT_TO = 0.9  # an eviction stops at this fraction of the capacity


def check_key(key: str) -> None:
    """Raise ValueError for a key outside ``[0-9a-z-]{1,128}`` (a programming error: keys are
    made by ``cache.storage.keys``)."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise ValueError(f"bad storage key {key!r}: keys are 1-128 characters of [0-9a-z-]")


def _host_tag() -> str:
    return re.sub(r"[^0-9A-Za-z-]", "-", socket.gethostname())[:64] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


@register_storage_backend("file")
class FileStorage(StorageBackend):
    """Objects as files under ``root`` (see the module docstring). Thread-safe: a lock guards
    the running totals only; file operations rely on the file system's atomic rename."""

    name = "file"

    def __init__(self, root: str, capacity_bytes: int = 0, retry_after_s: float = 30.0) -> None:
        super().__init__(capacity_bytes)
        self.root = os.path.abspath(root)
        self.objects_dir = os.path.join(self.root, "objects")
        self.tmp_dir = os.path.join(self.root, "tmp")
        os.makedirs(self.objects_dir, exist_ok=True)
        os.makedirs(self.tmp_dir, exist_ok=True)
        self.retry_after_s = retry_after_s
        self._host = _host_tag()
        self._lock = threading.Lock()
        self._evict_lock = threading.Lock()
        self._scanned = False
        self._objects = 0
        self._bytes = 0
        self._write_failing = False  # the warning was logged; cleared by a successful write
        self._writes_paused_until = 0.0
        self._read_failing = False
        removed = self.remove_stale_temp_files()
        if removed:
            logger.info("removed %d stale temp file(s) from %s", removed, self.tmp_dir)

    # ----------------------------------------------------------------------------- paths
    def _path(self, key: str) -> str:
        return os.path.join(self.objects_dir, key[:2], key)

    def _temp_path(self) -> str:
        name = f"{self._host}_{os.getpid()}_{secrets.token_hex(8)}.tmp"
        return os.path.join(self.tmp_dir, name)

    def remove_stale_temp_files(
        self, max_age_s: float = STALE_TEMP_S, *, every: bool = False
    ) -> int:
        """Remove temp files left by dead writers: over ``max_age_s`` old, or written on this
        host by a process that no longer exists (``every``: all of them). Returns how many
        were removed."""
        removed = 0
        now = time.time()
        try:
            entries = list(os.scandir(self.tmp_dir))
        except OSError as e:
            logger.warning("cannot list %s: %s", self.tmp_dir, e)
            return 0
        for entry in entries:
            stale = every
            try:
                stale = stale or now - entry.stat().st_mtime > max_age_s
            except FileNotFoundError:
                continue
            except OSError:
                pass
            if not stale:
                host, _, rest = entry.name.partition("_")
                pid_text = rest.partition("_")[0]
                stale = host == self._host and pid_text.isdigit() and not _pid_alive(int(pid_text))
            if stale:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    logger.warning("cannot remove stale temp file %s: %s", entry.path, e)
        return removed

    def _scan(self) -> list[tuple[int, int, str]]:
        """Every object as ``(mtime_ns, bytes, path)``; the rare path (start, eviction)."""
        out: list[tuple[int, int, str]] = []
        try:
            shards = list(os.scandir(self.objects_dir))
        except OSError as e:
            logger.warning("cannot list %s: %s", self.objects_dir, e)
            return out
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path))
            except OSError:  # not a directory, or removed meanwhile
                continue
            for entry in entries:
                if _KEY.fullmatch(entry.name) is None:
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                out.append((st.st_mtime_ns, st.st_size, entry.path))
        return out

    def _ensure_scanned(self) -> None:
        with self._lock:
            if self._scanned:
                return
            entries = self._scan()
            self._objects = len(entries)
            self._bytes = sum(size for _, size, _ in entries)
            self._scanned = True

    def _account(self, objects: int, nbytes: int) -> int:
        with self._lock:
            self._objects = max(0, self._objects + objects)
            self._bytes = max(0, self._bytes + nbytes)
            return self._bytes

    # ----------------------------------------------------------------------------- writes
    def _write_one(self, key: str, parts: Sequence[Buffer]) -> None:
        """Write the object to a temp file, fsync, rename into place; raise OSError on failure
        (the temp file is removed first)."""
        tmp = self._temp_path()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                size = 0
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                        size += n
                now = time.time_ns()  # explicit: file times come from a coarse clock
                os.utime(fd, ns=(now, now))
                os.fsync(fd)
            finally:
                os.close(fd)
            final = self._path(key)
            try:
                old = os.stat(final).st_size
            except FileNotFoundError:
                old = None
            try:
                os.rename(tmp, final)
            except FileNotFoundError:  # first object of its shard
                os.makedirs(os.path.dirname(final), exist_ok=True)
                os.rename(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._account(0 if old is not None else 1, size - (old or 0))

    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        for key, _ in items:
            check_key(key)
        out = [False] * len(items)
        if not items or time.monotonic() < self._writes_paused_until:
            return out
        self._ensure_scanned()
        for i, (key, parts) in enumerate(items):
            try:
                self._write_one(key, parts)
            except OSError as e:
                # the rest of the batch is skipped too: the store is failing, not this object
                with self._lock:
                    first = not self._write_failing
                    self._write_failing = True
                    self._writes_paused_until = time.monotonic() + self.retry_after_s
                if first:
                    logger.warning(
                        "storage write to %s failed (%s); skipping writes to it for %.0f s, "
                        "serving goes on from RAM",
                        self.root,
                        e,
                        self.retry_after_s,
                    )
                break
            out[i] = True
            if self._write_failing:
                with self._lock:
                    recovered, self._write_failing = self._write_failing, False
                if recovered:
                    logger.info("storage writes to %s succeed again", self.root)
        if any(out):
            self._evict_if_needed()
        return out

    def _evict_if_needed(self) -> None:
        cap = self.capacity_bytes
        if cap <= 0:
            return
        with self._lock:
            if self._bytes <= cap:
                return
        if not self._evict_lock.acquire(blocking=False):
            return  # another thread is evicting
        try:
            entries = self._scan()  # also re-syncs the totals with other processes' writes
            entries.sort()
            total = sum(size for _, size, _ in entries)
            count = len(entries)
            target = int(cap * EVICT_TO)
            removed = 0
            for _, size, path in entries:
                if total <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:  # removed by another process: gone all the same
                    pass
                except OSError as e:
                    logger.warning("cannot evict %s: %s", path, e)
                    continue
                total -= size
                count -= 1
                removed += 1
            with self._lock:
                self._objects, self._bytes = count, total
            logger.debug("evicted %d object(s) from %s; %d bytes left", removed, self.root, total)
        finally:
            self._evict_lock.release()

    # ----------------------------------------------------------------------------- reads
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        for key in keys:
            check_key(key)
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                out.append(None)
                continue
            except OSError as e:
                if not self._read_failing:
                    self._read_failing = True
                    logger.warning("storage read of %s failed (%s); treated as a miss", path, e)
                out.append(None)
                continue
            self._read_failing = False
            now = time.time_ns()
            try:
                os.utime(path, ns=(now, now))  # a use: shared LRU order
            except OSError:  # evicted meanwhile, or not ours to touch
                pass
            out.append(data)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            check_key(key)
        return [os.path.exists(self._path(key)) for key in keys]

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            check_key(key)
        self._ensure_scanned()
        for key in keys:
            path = self._path(key)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                logger.warning("cannot delete %s: %s", path, e)
                continue
            self._account(-1, -size)

    def usage(self) -> StorageUsage:
        self._ensure_scanned()
        with self._lock:
            return StorageUsage(objects=self._objects, bytes=self._bytes)

    def clear(self) -> int:
        """Remove every object and every temp file (a writer in flight elsewhere then fails its
        rename and answers False). Returns the number of objects removed."""
        removed = 0
        for _, _, path in self._scan():
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("cannot remove %s: %s", path, e)
        self.remove_stale_temp_files(every=True)
        with self._lock:
            self._objects, self._bytes, self._scanned = 0, 0, True
        return removed
