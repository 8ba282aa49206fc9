"""The scale-out tests' fixtures: sglang-router present, and one stack (``scaleout_stack``)
shared by the tests of a module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from scaleout_stack import Stack, start_stack

try:
    import sglang_router
except ImportError:  # a test dependency: its absence is a broken setup, not a reason to skip
    sglang_router = None


@pytest.fixture(scope="session", autouse=True)  # session: set up before the module's stack
def _require_sglang_router() -> None:
    if sglang_router is None:
        pytest.fail(
            "the scale-out tests need sglang-router 0.3.2, a test dependency that is not "
            "installed: .venv/bin/pip install -e '.[test]' (or: .venv/bin/pip install "
            "'sglang-router==0.3.2')",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    log = tmp_path_factory.mktemp("scaleout") / "launcher.log"
    # the launcher, not the gateway's health check, routes around a dead replica: the check's
    # period is longer than any wait of the tests
    st = start_stack(log, "--router-policy", "cache_aware",
                     "--router-health-check-interval-secs", "600")  # fmt: skip
    try:
        st.wait_ready()
        yield st
    finally:
        st.stop()
