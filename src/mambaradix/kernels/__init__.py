"""Kernels: torch reference operations (CPU) registered by name; other backends beside them."""

from __future__ import annotations

from mambaradix.kernels.registry import (
    get_backend,
    get_kernel,
    list_kernels,
    register_kernel,
    set_backend,
)

__all__ = ["get_backend", "get_kernel", "list_kernels", "register_kernel", "set_backend"]
