"""Kernel registry: operations registered by name and backend.

Model code asks for an operation by name (``get_kernel("causal_conv1d")``) and gets the
implementation of the active backend, falling back to the ``torch`` reference when the active
backend does not provide that operation. A GPU backend is added by registering functions with the
same signatures under another backend name and calling ``set_backend``; no model code changes.

The ``torch`` kernels are the reference every other backend is tested against; they run on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

REFERENCE_BACKEND = "torch"

_KERNELS: dict[str, dict[str, Callable[..., Any]]] = {}
_active_backend = REFERENCE_BACKEND


def register_kernel(name: str, backend: str = REFERENCE_BACKEND) -> Callable[[F], F]:
    """Decorator: register ``fn`` as operation ``name`` of ``backend`` (last registration wins)."""

    def deco(fn: F) -> F:
        _KERNELS.setdefault(name, {})[backend] = fn
        return fn

    return deco


def get_kernel(name: str, backend: str | None = None) -> Callable[..., Any]:
    """The implementation of ``name`` for ``backend`` (default: the active backend).

    Falls back to the torch reference when the backend lacks the operation; raises KeyError
    naming the known operations when no backend has it.
    """
    _ensure_reference_kernels()
    impls = _KERNELS.get(name)
    if not impls:
        raise KeyError(f"unknown kernel {name!r}; registered: {sorted(_KERNELS)}")
    be = backend or _active_backend
    if be in impls:
        return impls[be]
    if REFERENCE_BACKEND in impls:
        return impls[REFERENCE_BACKEND]
    raise KeyError(f"kernel {name!r} has no {be!r} or torch implementation: {sorted(impls)}")


def set_backend(backend: str) -> None:
    """Make ``backend`` the default for ``get_kernel`` (operations it lacks fall back to torch)."""
    global _active_backend
    _ensure_reference_kernels()
    known = {b for impls in _KERNELS.values() for b in impls}
    if backend not in known:
        raise ValueError(f"unknown kernel backend {backend!r}; registered: {sorted(known)}")
    _active_backend = backend
    logger.info("kernel backend set to %s", backend)


def get_backend() -> str:
    return _active_backend


def list_kernels() -> dict[str, list[str]]:
    """Operation name -> backends that implement it."""
    _ensure_reference_kernels()
    return {name: sorted(impls) for name, impls in sorted(_KERNELS.items())}


def _ensure_reference_kernels() -> None:
    # Importing the modules registers their kernels; done lazily to avoid import cycles.
    from mambaradix.kernels import attention, conv, cpu, gated_delta, moe, norm, rope  # noqa: F401

    try:  # helper modules that may not exist yet in a partial checkout
        from mambaradix.kernels import mamba2  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "mambaradix.kernels.mamba2":
            raise
