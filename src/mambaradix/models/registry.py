"""Model registry: model classes keyed by Hugging Face architecture name (``config.architectures``).

Model modules register themselves with ``@register_model("Qwen3NextForCausalLM", ...)``; the
registry imports every known model module on first lookup, so callers need not.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=type)

# Modules that define models; imported lazily. A module missing from a partial checkout is skipped.
MODEL_MODULES = (
    "mambaradix.models.qwen3_next",
    "mambaradix.models.granite_hybrid",
    "mambaradix.models.nemotron_h",
    "mambaradix.models.lfm2",
    "mambaradix.models.falcon_h1",
    "mambaradix.models.olmo_hybrid",
)

_MODELS: dict[str, type] = {}
_loaded = False


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no implementation here."""


def register_model(*architectures: str) -> Callable[[T], T]:
    """Class decorator: register a model class under one or more HF architecture names."""

    def deco(cls: T) -> T:
        for arch in architectures:
            _MODELS[arch] = cls
        return cls

    return deco


def import_model_modules() -> None:
    """Import every known model module (registering its models and tiny builders)."""
    global _loaded
    if _loaded:
        return
    for name in MODEL_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            logger.debug("model module %s not present", name)
    _loaded = True


def supported_architectures() -> list[str]:
    import_model_modules()
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type:
    """The registered class for the first supported name in ``architectures``.

    Raises ``UnsupportedArchitectureError`` naming the architecture(s) and the supported ones.
    """
    import_model_modules()
    if not architectures:
        raise UnsupportedArchitectureError(
            "config.json has no 'architectures' list; add one, e.g. "
            f'"architectures": ["Qwen3NextForCausalLM"]. Supported: {supported_architectures()}'
        )
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {', '.join(architectures)}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
