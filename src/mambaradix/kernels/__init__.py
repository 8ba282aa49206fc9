"""Kernels: the backend contract (``backend``), the torch reference (``torch_backend`` over the
reference ops in this folder) and the native CPU backend (``cpu_backend`` over ``cpu``)."""

from __future__ import annotations

from mambaradix.kernels.backend import (
    REFERENCE_BACKEND,
    KernelBackend,
    backend_names,
    create_backend,
    reference_backend,
    register_backend,
)
from mambaradix.kernels.capabilities import BackendCapabilities

__all__ = [
    "REFERENCE_BACKEND",
    "BackendCapabilities",
    "KernelBackend",
    "backend_names",
    "create_backend",
    "reference_backend",
    "register_backend",
]
