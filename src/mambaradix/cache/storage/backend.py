"""The storage tier's backend interface: a content-addressed object store.

Keys are printable ASCII strings (``[0-9a-z-]``, at most 128 characters) made by
``cache.storage.keys``; values are whole encoded objects (``cache.storage.objects``). A backend
stores bytes and knows nothing of their meaning; it never unpickles or evaluates them.

Every call is batched and must not raise for an unavailable store (a full disk, an unreachable
server): the backend logs the first failure once, answers as if the objects were absent (``get``
-> None, ``exists`` -> False, ``put`` -> False) and keeps serving; it may retry later on its own.
Calls come from the tier's I/O threads and from the scheduler (``exists``), so a backend must be
thread-safe.

``capacity_bytes`` > 0 bounds the bytes the backend keeps: after a ``put`` the least recently
used objects (by put or get) are removed until the total fits.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True)
class StorageUsage:
    objects: int
    bytes: int


class StorageBackend(ABC):
    """Batched put / get / exists / delete over opaque objects (see the module docstring)."""

    name = "abstract"

    def __init__(self, capacity_bytes: int = 0) -> None:
        self.capacity_bytes = capacity_bytes

    @abstractmethod
    def put(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> list[bool]:
        """Store each ``(key, parts)``: the object is the concatenation of ``parts``. Atomic per
        object: a reader sees the whole object or none. Overwriting a key is allowed (two
        writers of one key write the same content). True where stored."""

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The stored bytes of each key, or None (absent or unreadable). Counts as a use."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored (a hint: a later ``get`` may still miss)."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove the keys (absent ones are ignored)."""

    @abstractmethod
    def usage(self) -> StorageUsage:
        """Objects and bytes stored (as far as this process can tell cheaply)."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every object of this store; returns how many were removed."""

    def close(self) -> None:  # noqa: B027 (optional: most backends hold nothing to release)
        """Release connections and threads."""


_BACKENDS: dict[str, Callable[..., StorageBackend]] = {}


def register_storage_backend(name: str) -> Callable:
    def wrap(cls: Callable[..., StorageBackend]) -> Callable[..., StorageBackend]:
        _BACKENDS[name] = cls
        return cls

    return wrap


def storage_backend_names() -> list[str]:
    return sorted(_BACKENDS)


def create_storage_backend(name: str, **options: object) -> StorageBackend:
    """``name``: ``file`` (options ``root``, ``capacity_bytes``) or ``redis`` (``url``,
    ``capacity_bytes``, ``namespace``)."""
    from mambaradix.cache.storage import file_backend, redis_backend  # noqa: F401 (register)

    if name not in _BACKENDS:
        raise ValueError(
            f"unknown --hicache-storage-backend {name!r}; choose one of {storage_backend_names()}"
        )
    return _BACKENDS[name](**options)
