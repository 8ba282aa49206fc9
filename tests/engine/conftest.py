from __future__ import annotations

import os
import random
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)
