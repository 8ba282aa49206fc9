"""The suite's thread settings (tests/conftest.py): in a pytest-xdist worker a test runs torch on
one thread, and a ``threaded`` test (the native kernels' tests) on every core, so their split of
work over OpenMP threads stays tested when the suite runs in parallel workers."""

from __future__ import annotations

import os

import pytest
import torch

IN_WORKER = "PYTEST_XDIST_WORKER" in os.environ

pytestmark = pytest.mark.skipif(not IN_WORKER, reason="settings of pytest-xdist workers (-n)")


@pytest.mark.threaded
def test_a_threaded_test_runs_on_every_core() -> None:
    assert torch.get_num_threads() == (os.cpu_count() or 1)


def test_other_tests_run_on_one_thread() -> None:
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"  # and the processes they start
