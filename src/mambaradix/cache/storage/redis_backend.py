"""The ``redis`` storage backend: objects as Redis strings, shared by every process and machine
that reaches the server.

Keys of a store (``ns`` = ``namespace``)::

    {ns}:obj:<key>   the object's bytes
    {ns}:lru         sorted set: key -> time of its last put or get (client clock, seconds)
    {ns}:size        hash: key -> the object's bytes
    {ns}:bytes       counter: the sum of {ns}:size

A put, a delete and an eviction each run as one small Lua script, so the object, its size, its
LRU entry and the counter change together (an overwrite subtracts the old size exactly once,
whichever client wrote it); batches go in one pipeline (one round trip). ``get`` is one MGET
plus a ``ZADD XX`` of the hits' times in the same pipeline. With ``capacity_bytes`` > 0, a put
that leaves the counter over capacity runs the eviction script, which pops the oldest keys until
the counter is at most 90% of capacity.

Availability: a connection error, a timeout or any error answer (the server out of memory, a
read-only replica) is logged once; calls then answer as absent (``get`` None, ``exists`` False,
``put`` False) without touching the network for ``retry_after_s`` seconds, then try again;
recovery is logged once. Nothing raises for an unavailable server.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mambaradix.cache.storage.backend import (
    Buffer,
    StorageBackend,
    StorageUsage,
    register_storage_backend,
)
from mambaradix.cache.storage.file_backend import EVICT_TO, check_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

# KEYS: obj, lru, size, bytes; ARGV: data, key, score. Returns the new total bytes.
_PUT = """
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '0')
local n = string.len(ARGV[1])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[2], n)
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
return redis.call('INCRBY', KEYS[4], n - old)
"""

# KEYS: obj, lru, size, bytes; ARGV: key. Returns 1 if an object was removed.
_DELETE = """
local old = redis.call('HGET', KEYS[3], ARGV[1])
local removed = redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if old then redis.call('DECRBY', KEYS[4], tonumber(old)) end
return removed
"""

# KEYS: lru, size, bytes; ARGV: target bytes, object key prefix. Returns {total, removed}.
_EVICT = """
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
local target = tonumber(ARGV[1])
local removed = 0
while total > target do
  local popped = redis.call('ZPOPMIN', KEYS[1], 1)
  if #popped == 0 then
    -- the counter drifted (keys removed by hand): recount from the size hash
    total = 0
    for _, v in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(v) end
    redis.call('SET', KEYS[3], total)
    break
  end
  local key = popped[1]
  local n = tonumber(redis.call('HGET', KEYS[2], key) or '0')
  redis.call('DEL', ARGV[2] .. key)
  redis.call('HDEL', KEYS[2], key)
  total = redis.call('DECRBY', KEYS[3], n)
  removed = removed + 1
end
return {total, removed}
"""


@register_storage_backend("redis")
class RedisStorage(StorageBackend):
    """Objects in a Redis server under ``namespace`` (see the module docstring). Thread-safe:
    the client's connection pool is; each call makes its own pipeline."""

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        capacity_bytes: int = 0,
        namespace: str = "mambaradix",
        retry_after_s: float = 5.0,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
    ) -> None:
        super().__init__(capacity_bytes)
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(
                "the redis storage backend needs the redis client: pip install 'mambaradix[redis]'"
            ) from e
        self.url = url
        self.namespace = namespace
        self.retry_after_s = retry_after_s
        self._errors = (redis.RedisError, OSError)
        # one immediate retry: after a server restart the pooled connection is dead but a new
        # one works; more retries would only delay the answer for a server that is down
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._put_script = self._client.register_script(_PUT)
        self._delete_script = self._client.register_script(_DELETE)
        self._evict_script = self._client.register_script(_EVICT)
        self._lru = f"{namespace}:lru"
        self._size = f"{namespace}:size"
        self._bytes = f"{namespace}:bytes"
        self._obj_prefix = f"{namespace}:obj:"
        self._lock = threading.Lock()
        self._down = False  # the failure was logged; cleared (and logged) by a success
        self._down_until = 0.0

    def _obj(self, key: str) -> str:
        return self._obj_prefix + key

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` while the server is failing (see the module docstring)."""
        if time.monotonic() < self._down_until:
            return default
        try:
            result = fn()
        except self._errors as e:
            with self._lock:
                first = not self._down
                self._down = True
                self._down_until = time.monotonic() + self.retry_after_s
            if first:
                logger.warning(
                    "redis storage at %s failed (%s: %s: %s); answering as absent, retrying "
                    "every %.0f s, serving goes on from RAM",
                    self.url,
                    what,
                    type(e).__name__,
                    e,
                    self.retry_after_s,
                )
            return default
        if self._down:
            with self._lock:
                recovered, self._down = self._down, False
            if recovered:
                logger.info("redis storage at %s works again", self.url)
        return result

    # ----------------------------------------------------------------------------- calls
    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        for key, _ in items:
            check_key(key)
        if not items:
            return []

        def run() -> list[bool]:
            now = time.time()
            pipe = self._client.pipeline(transaction=False)
            for key, parts in items:
                data = b"".join(parts)
                self._put_script(
                    keys=[self._obj(key), self._lru, self._size, self._bytes],
                    args=[data, key, now],
                    client=pipe,
                )
            totals = pipe.execute()
            cap = self.capacity_bytes
            if cap > 0 and max(int(t) for t in totals) > cap:
                total, removed = self._evict_script(
                    keys=[self._lru, self._size, self._bytes],
                    args=[int(cap * EVICT_TO), self._obj_prefix],
                )
                logger.debug("evicted %d object(s) from redis; %d bytes left", removed, total)
            return [True] * len(items)

        return self._call("put", run, [False] * len(items))

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        for key in keys:
            check_key(key)
        if not keys:
            return []

        def run() -> list[bytes | None]:
            now = time.time()
            pipe = self._client.pipeline(transaction=False)
            pipe.mget([self._obj(k) for k in keys])
            # XX: only keys still listed (a miss adds no LRU entry)
            pipe.zadd(self._lru, dict.fromkeys(keys, now), xx=True)
            values, _ = pipe.execute()
            return list(values)

        return self._call("get", run, [None] * len(keys))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            check_key(key)
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._obj(key))
            return [bool(n) for n in pipe.execute()]

        return self._call("exists", run, [False] * len(keys))

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            check_key(key)
        if not keys:
            return

        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                self._delete_script(
                    keys=[self._obj(key), self._lru, self._size, self._bytes],
                    args=[key],
                    client=pipe,
                )
            pipe.execute()

        self._call("delete", run, None)

    def usage(self) -> StorageUsage:
        def run() -> StorageUsage:
            pipe = self._client.pipeline(transaction=False)
            pipe.hlen(self._size)
            pipe.get(self._bytes)
            objects, nbytes = pipe.execute()
            return StorageUsage(objects=int(objects), bytes=int(nbytes or 0))

        return self._call("usage", run, StorageUsage(objects=0, bytes=0))

    def clear(self) -> int:
        """Delete every key of the namespace; returns the number of objects removed (0 when
        the server is unreachable)."""

        def run() -> int:
            pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self.namespace) + ":*"
            prefix = self._obj_prefix.encode()
            removed = 0
            batch: list[Any] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    self._client.unlink(*batch)
                    removed += sum(n.startswith(prefix) for n in batch)
                    batch = []
            if batch:
                self._client.unlink(*batch)
                removed += sum(n.startswith(prefix) for n in batch)
            return removed

        return self._call("clear", run, 0)

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors:
            pass
