"""The suite's ``big_memory`` marker (tests/memory_lock.py's ``_big_memory``): tests marked with it
never run at the same time in two pytest-xdist workers; unmarked ones do (the control that the
run was parallel at all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

BODY = """
import json, os, time
import pytest

def record(tmp_path_factory, name):
    start = time.monotonic()
    time.sleep(1.0)
    out = tmp_path_factory.getbasetemp().parent / f"{name}.json"
    out.write_text(json.dumps([start, time.monotonic()]))

@pytest.mark.big_memory
@pytest.mark.parametrize("i", range(2))
def test_big(tmp_path_factory, i):
    record(tmp_path_factory, f"big{i}")

@pytest.mark.parametrize("i", range(2))
def test_small(tmp_path_factory, i):
    record(tmp_path_factory, f"small{i}")
"""

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from memory_lock import _big_memory  # noqa: F401  (the fixture under test)

def pytest_configure(config):
    config.addinivalue_line("markers", "big_memory: one at a time")
"""


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _run(tmp_path: Path, select: str) -> dict[str, list[float]]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_lock.py").write_text(BODY)
    base = tmp_path / "base"
    base.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
           "--basetemp", str(base / "run"), "-m", select, "-c", "/dev/null",
           "--rootdir", str(tmp_path), str(tmp_path / "test_lock.py")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return {p.stem: json.loads(p.read_text()) for p in (base / "run").glob("*.json")}


def test_big_memory_tests_never_overlap(tmp_path):
    times = _run(tmp_path, "big_memory")
    assert sorted(times) == ["big0", "big1"]
    assert not _overlap(times["big0"], times["big1"]), times


def test_unmarked_tests_do_overlap(tmp_path):
    """Control: the same tests unmarked run at once in the two workers."""
    times = _run(tmp_path, "not big_memory")
    assert sorted(times) == ["small0", "small1"]
    assert _overlap(times["small0"], times["small1"]), times
