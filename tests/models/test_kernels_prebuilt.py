"""The native kernels are built when the package is installed (setup.py, ``kernels.native_build``):
an installed tree loads them as they are, compiling nothing at its first start; a build that
is not exactly what the run time would compile (another compiler here) is not loaded, and the
run time compiles then; an install without a working compiler does not fail.

Each check of what a process loads runs in a child process with its own empty kernel cache
(``$MAMBARADIX_KERNEL_CACHE``), torch imported first as the engine does (its libgomp decides
the OpenMP flag)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mambaradix.kernels import native, native_build

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys, time
import torch
from mambaradix.kernels import native
names = sys.argv[1:] or list(native.SIGNATURES)
t0 = time.perf_counter()
ok = all(native.load(n) is not None for n in names) if sys.argv[1:] else native.available()
print(json.dumps({"ok": ok, "origins": native.origins(), "s": time.perf_counter() - t0,
                  "file": native.__file__}))
"""


def probe(cache: Path, *names: str, **env: str) -> dict:
    """What a fresh process loads (``names``, default: every library, as the engine does)."""
    env = {**os.environ, "MAMBARADIX_KERNEL_CACHE": str(cache), **env}
    out = subprocess.run([sys.executable, "-c", PROBE, *names], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


def installed_manifest() -> dict:
    manifest = native_build.read_manifest()
    if manifest is None:
        pytest.skip("this source tree was never installed: pip install -e '.[test]' builds them")
    if manifest["sources"] != native_build.sources_digest():
        pytest.skip("C sources edited since the install: pip install -e . builds them again")
    return manifest


@needs_cc
def test_an_installed_tree_loads_prebuilt_kernels_without_compiling(tmp_path):
    manifest = installed_manifest()
    assert "error" not in manifest and not manifest["failed"], manifest  # a compiler is here
    assert sorted(manifest["libraries"]) == native_build.library_names()
    cache = tmp_path / "cache"
    seen = probe(cache)
    assert seen["ok"]
    assert seen["origins"] == dict.fromkeys(native.SIGNATURES, "prebuilt"), seen
    assert not cache.exists() or not any(cache.iterdir())  # nothing compiled
    print(f"all {len(seen['origins'])} kernels loaded in {seen['s']:.2f} s")


@needs_cc
def test_a_build_by_another_compiler_is_not_loaded_but_compiled_once(tmp_path):
    """Negative control: with ``CC=gcc`` (another ``--version`` than ``cc``'s, so another key)
    the prebuilt library is passed over and compiled into the cache; the next process loads it
    from there."""
    installed_manifest()
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    cache = tmp_path / "cache"
    first = probe(cache, "sampling", CC="gcc")
    assert first["ok"] and first["origins"] == {"sampling": "compiled"}, first
    assert len(list(cache.glob("sampling-*.so"))) == 1
    again = probe(cache, "sampling", CC="gcc")
    assert again["origins"] == {"sampling": "cache"}, again


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"], ids=["no-compiler", "failing"])
def test_install_time_build_never_fails_the_install(tmp_path, monkeypatch, cc):
    monkeypatch.setenv("CC", cc)
    native_build.compiler_version.cache_clear()
    manifest = native_build.prebuild(tmp_path / "prebuilt")
    assert manifest["libraries"] == {}
    assert "error" in manifest or set(manifest["failed"]) == set(native_build.library_names())
    assert native_build.read_manifest(tmp_path / "prebuilt") == manifest
    assert not list((tmp_path / "prebuilt").glob("*.so"))


@needs_cc
@pytest.mark.slow
def test_pip_install_puts_the_kernels_in_the_wheel(tmp_path):
    """``pip install .`` (not editable) of a copy of the tree: the installed package loads
    every kernel prebuilt."""
    src = tmp_path / "src"
    for part in ("src", "setup.py", "pyproject.toml", "README.md"):
        copy = shutil.copytree if (ROOT / part).is_dir() else shutil.copy
        copy(ROOT / part, src / part)
    for stale in (src / "src/mambaradix/kernels/prebuilt", *src.rglob("__pycache__")):
        shutil.rmtree(stale, ignore_errors=True)
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--target", str(target), str(src)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = native_build.read_manifest(target / "mambaradix/kernels/prebuilt")
    assert manifest is not None and not manifest["failed"] and "error" not in manifest, manifest
    pythonpath = os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])
    seen = probe(tmp_path / "cache", PYTHONPATH=pythonpath)
    assert Path(seen["file"]).is_relative_to(target), seen  # the installed copy, not this tree
    assert seen["ok"] and set(seen["origins"].values()) == {"prebuilt"}, seen
