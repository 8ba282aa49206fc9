"""Building the native kernels (``csrc/<name>.c`` -> ``<name>-<key>.so``): the compiler, the
flags, the key that names a build, and the compile itself.

Two callers: ``setup.py`` at install time (``prebuild``: every library into ``prebuilt/``
beside this file, in parallel), and ``native.load`` at run time, which looks for the file its
key names in ``prebuilt/`` first, then in the kernel cache, and compiles into the cache only
when neither has it. The key hashes the sources (the library's ``.c`` and every shared
header), the flags, the compiler's ``--version`` and this CPU's model and features, so a build
is used only where it is exactly what the run time would compile: an edited source, another
compiler or another CPU (``-march=native``) never loads a stale or foreign library.

Standard library only: setup.py loads this file by its path, where torch is not installed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
PREBUILT = Path(__file__).parent / "prebuilt"  # filled at install time (setup.py)
MANIFEST = "manifest.json"  # in PREBUILT: what the install-time build did
# -fno-trapping-math: no kernel reads the floating-point exception flags, and without it GCC
# keeps the comparisons of a loop (exp_poly's clamp) as branches, so the loop does not vectorise;
# it changes no value (ISO C still forbids contraction and reassociation)
BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fopenmp-simd",
              "-fno-trapping-math")  # fmt: skip


def library_names() -> list[str]:
    return sorted(p.stem for p in CSRC.glob("*.c"))


def compiler() -> str | None:
    """The system C compiler: ``$CC``, else ``cc``; None when not on the PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


@functools.cache
def compiler_version(cc: str) -> str | None:
    """``cc --version`` (part of every key), or None when ``cc`` does not run."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None


@functools.cache
def cpu_id() -> str:
    """Model and feature flags of this CPU: ``-march=native`` code built on one machine may not
    run on another that shares the cache folder."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in info.splitlines() if ln.startswith(wanted)}))


def flags(openmp: bool) -> list[str]:
    """Compile flags (the include folder apart: it is where the sources lie, not what they are).
    ``openmp``: link the OpenMP runtime (libgomp), which the process must already have loaded
    (``native._uses_libgomp``)."""
    return [*BASE_FLAGS, "-fopenmp"] if openmp else list(BASE_FLAGS)


def sources_digest() -> str:
    """Hash of every C source and header (recorded in the manifest: an install whose sources
    were edited since no longer has every prebuilt library its run time looks for)."""
    files = sorted([*CSRC.glob("*.c"), *CSRC.glob("*.h")])
    return hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()


def library_key(name: str, build_flags: list[str], version: str) -> str:
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # shared helpers
    return hashlib.sha256(
        (CSRC / f"{name}.c").read_bytes()
        + headers
        + " ".join(build_flags).encode()
        + version.encode()
        + cpu_id().encode()
    ).hexdigest()[:16]


def library_file(directory: Path, name: str, key: str) -> Path:
    return directory / f"{name}-{key}.so"


def compile_library(cc: str, build_flags: list[str], name: str, out: Path) -> str | None:
    """Compile ``csrc/<name>.c`` into ``out``, written whole or not at all (another process
    sees the complete file or none). The compiler's error output on failure, else None."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        cmd = [cc, *build_flags, f"-I{CSRC}", "-o", tmp, str(CSRC / f"{name}.c"), "-lm"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            return res.stderr[-2000:] or f"{cc} exited with {res.returncode}"
        os.replace(tmp, out)
    except OSError as e:
        return str(e)
    return None


def compile_libraries(
    cc: str, build_flags: list[str], outputs: dict[str, Path], jobs: int = 0
) -> dict[str, str]:
    """Compile several libraries at once (``jobs`` compilers, default: one per core).
    The failures: name -> error output."""
    jobs = jobs or _cores()
    with ThreadPoolExecutor(max(1, min(jobs, len(outputs)))) as pool:
        errors = pool.map(lambda item: compile_library(cc, build_flags, *item), outputs.items())
        return {name: err for name, err in zip(outputs, errors) if err is not None}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def install_time_openmp() -> bool:
    """Whether the run time will link OpenMP, guessed where torch is not importable (it is
    installed after the package is built): torch's Linux wheels load GNU OpenMP
    (``torch/lib/libgomp.so.1``), the others LLVM's or Intel's, which the kernels do not link.
    A wrong guess costs one compile at the first start, nothing else (another key)."""
    return sys.platform.startswith("linux")


def prebuild(directory: Path, openmp: bool | None = None) -> dict:
    """Compile every library into ``directory`` (replacing what an earlier install put there)
    and write its manifest. Never raises: without a compiler, or where a library does not
    compile, the manifest says why and the run time compiles on first use as before."""
    started = time.perf_counter()
    openmp = install_time_openmp() if openmp is None else openmp
    manifest: dict = {"openmp": openmp, "sources": sources_digest(), "libraries": {},
                      "failed": {}}  # fmt: skip
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*.so"):
            old.unlink()
    except OSError as e:
        manifest["error"] = f"cannot write {directory}: {e}"
        return manifest
    cc = compiler()
    version = compiler_version(cc) if cc is not None else None
    if cc is None or version is None:
        manifest["error"] = f"no usable C compiler ($CC or cc): {os.environ.get('CC', 'cc')}"
    else:
        build_flags = flags(openmp)
        manifest["compiler"] = version.splitlines()[0] if version else cc
        outputs = {name: library_file(directory, name, library_key(name, build_flags, version))
                   for name in library_names()}  # fmt: skip
        failed = manifest["failed"] = compile_libraries(cc, build_flags, outputs)
        manifest["libraries"] = {n: p.name for n, p in outputs.items() if n not in failed}
    manifest["seconds"] = round(time.perf_counter() - started, 2)
    with contextlib.suppress(OSError):
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(directory: Path = PREBUILT) -> dict | None:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
