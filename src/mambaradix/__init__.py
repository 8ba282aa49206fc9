"""mambaradix: a serving engine for hybrid attention + recurrent language models."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "EngineConfig"]


def __getattr__(name: str) -> Any:  # lazy: importing the package does not load torch
    if name == "Engine":
        from mambaradix.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from mambaradix.core import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from mambaradix.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
