"""Model tests: a session cache of tiny checkpoints and oracles (see model_oracle.py)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from model_oracle import Oracle, OracleCase, build_oracle

_ORACLES: dict[str, Oracle] = {}


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_ckpts")


@pytest.fixture(scope="session")
def oracle_for(tiny_root):
    """``oracle_for(case)`` -> an ``Oracle`` built once per session per case name."""

    def get(case: OracleCase) -> Oracle:
        if case.name not in _ORACLES:
            _ORACLES[case.name] = build_oracle(case, tiny_root)
        o = _ORACLES[case.name]
        o.reset()
        return o

    return get


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
