"""The ``big_memory`` marker's fixture (imported by tests/conftest.py; tests/test_big_memory.py
checks it in pytest-xdist workers)."""

from __future__ import annotations

import ctypes
import fcntl
import gc

import pytest


def _give_back_freed_memory() -> None:
    """Return the C heap's free pages to the system (the engine makes glibc keep them:
    ``engine/cpu_runtime.keep_freed_memory``)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(autouse=True)
def _big_memory(request: pytest.FixtureRequest, tmp_path_factory):
    """A test marked ``big_memory`` (a full-size checkpoint, every kernel compiled for a GPU:
    10-17 GB) holds a lock file the run's workers share, so no two run at once, and gives its
    freed memory back afterwards, so that the worker does not keep its peak beside the next
    one. Two at once filled the 24 GB of RAM and the kernel killed a worker. (pytest-xdist's
    ``--dist loadgroup`` cannot do this under pytest 9: it groups by renaming node ids through
    an attribute pytest no longer reads.)"""
    if request.node.get_closest_marker("big_memory") is None:
        yield
        return
    lock = tmp_path_factory.getbasetemp().parent / "big_memory.lock"
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            _give_back_freed_memory()
            fcntl.flock(fh, fcntl.LOCK_UN)
