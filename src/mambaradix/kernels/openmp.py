"""The OpenMP runtime this process has loaded (torch's own libgomp in the CPU builds).

A leaf module: the native kernels link their OpenMP code against this runtime, and the
engine's CPU runtime settings (``engine/cpu_runtime.py``) pause its thread pools.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

_RUNTIMES = ("libgomp", "libiomp", "libomp")


@functools.cache
def openmp_runtime_path() -> str | None:
    """File of the OpenMP runtime this process has loaded (found in /proc/self/maps), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to do
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.strip() else ""
        if path.startswith("/") and any(r in Path(path).name for r in _RUNTIMES):
            try:
                lib = ctypes.CDLL(path)  # already loaded: the same handle, no second copy
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                return path
    return None
