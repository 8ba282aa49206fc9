"""mambaradix: a serving engine for hybrid attention + recurrent language models."""

from __future__ import annotations

__version__ = "0.1.0"
