"""Settings every test directory shares.

The ``cuda`` backend's Triton kernels run on CPU tensors under the interpreter where no GPU is
(``tests/triton/interpreter.py``, installed before any kernel module is imported).

Hypothesis runs derandomised by default (profile ``ci``): the examples are a function of the
test alone, so a failure seen in CI reproduces with the same command on any machine.
``HYPOTHESIS_PROFILE=explore`` draws fresh random examples on each run (and keeps failures in
the local example database) to hunt for new ones.

The README's command runs the suite in one pytest-xdist worker per core (``-n auto``). Each
worker, and every process it starts, then runs torch and the native kernels on one thread, so
that the workers do not fight over the cores (two workers of two OpenMP threads each on 2
cores took longer than one process). The tests whose subject is the native kernels' split of
work over threads (``THREADED``, and any test marked ``threaded``) run on every core even so.

Tests marked ``big_memory`` (10-17 GB each) run one at a time across the workers
(``_big_memory``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from memory_lock import _big_memory  # noqa: F401  (an autouse fixture)

from mambaradix.models.transformers_torch_path import use_torch_path

THREADED = ("tests/models/test_kernels_", "tests/engine/test_cpu_runtime.py")
IN_WORKER = "PYTEST_XDIST_WORKER" in os.environ


use_torch_path()  # the transformers oracle (mambaradix.models.transformers_torch_path)

if importlib.util.find_spec("triton") is not None:
    # the cuda backend's Triton kernels run interpreted where no GPU is (tests/triton/)
    sys.path.insert(0, str(Path(__file__).parent / "triton"))
    import interpreter

    interpreter.install()

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    if IN_WORKER:
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # the servers and CLIs the tests start


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).parent.parent
    for item in items:
        if item.path.relative_to(root).as_posix().startswith(THREADED):
            item.add_marker(pytest.mark.threaded)


@pytest.fixture(scope="session", autouse=True)
def _session_spec_costs(tmp_path_factory):
    """The module- and session-scoped engines' ``--speculative-adaptive`` step costs in this
    run's temporary folder (set up before them; the per-test folder below comes after them):
    costs a past run left in ``~/.cache`` never steer a test (they once held a served
    engine's cap at 0 for all its steps)."""
    with pytest.MonkeyPatch.context() as mp:
        shared = tmp_path_factory.getbasetemp() / "spec-costs-shared"
        mp.setenv("MAMBARADIX_SPEC_COSTS", str(shared))
        yield


@pytest.fixture(autouse=True)
def _own_spec_costs(request: pytest.FixtureRequest, tmp_path_factory, monkeypatch) -> None:
    """Each test keeps ``--speculative-adaptive``'s step costs in a folder of its own
    (``engine/spec_costs.py``; not created until written): costs one test's engine measured
    never steer another's."""
    base = tmp_path_factory.getbasetemp() / "spec-costs"
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setenv("MAMBARADIX_SPEC_COSTS", str(base / digest))


@pytest.fixture(autouse=True)
def _threads_of_threaded_tests(request: pytest.FixtureRequest):
    """A ``threaded`` test runs on every core inside a one-thread worker (module docstring)."""
    if not IN_WORKER or request.node.get_closest_marker("threaded") is None:
        yield
        return
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(1)
