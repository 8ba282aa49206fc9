"""The Triton kernels' tests run under the interpreter where no GPU is (``interpreter.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import interpreter  # noqa: E402

interpreter.install()
