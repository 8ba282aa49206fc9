"""One ``mambaradix serve --dp-size 2`` stack (two tiny replicas, one thread each, behind the
SGLang Model Gateway) shared by the scale-out tests of a module; real processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from mambaradix.server.replicas import free_port

try:
    import sglang_router
except ImportError:  # a test dependency: its absence is a broken setup, not a reason to skip
    sglang_router = None

API_KEY = "scaleout-key"
MODEL = "tiny-qwen"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
REPLICA_FLAGS = [
    "--model-path", "tiny:qwen3_next", "--num-threads", "1", "--skip-warmup",
    "--max-total-tokens", "16384", "--max-mamba-cache-size", "64",
    "--served-model-name", MODEL, "--api-key", API_KEY, "--log-level", "warning",
    "--debug-integrity",  # the full check after every engine step of every replica
]  # fmt: skip


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Stack:
    proc: subprocess.Popen
    url: str
    log: Path
    replicas: list[str] = field(default_factory=list)

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", headers=AUTH, timeout=10).json()["workers"]

    def replica_pid(self, url: str) -> int | None:
        port = url.rsplit(":", 1)[1]
        for pid in children(self.proc.pid):
            if f"--port {port} " in cmdline(pid) + " " and "mambaradix" in cmdline(pid):
                return pid
        return None

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "launcher exited:\n" + self.log.read_text()[-3000:]
            try:
                ws = self.workers()
                if len(ws) == 2 and all(w["is_healthy"] for w in ws):
                    self.replicas = sorted(w["url"] for w in ws)
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise AssertionError("stack not ready:\n" + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


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
    port = free_port()
    log = tmp_path_factory.mktemp("scaleout") / "launcher.log"
    cmd = [sys.executable, "-m", "mambaradix.cli", "serve", *REPLICA_FLAGS, "--port", str(port),
           "--dp-size", "2", "--router-policy", "cache_aware",
           # the launcher, not the gateway's health check, routes around a dead replica: the
           # check's period is longer than any wait of the tests
           "--router-health-check-interval-secs", "600"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    st = Stack(proc, f"http://127.0.0.1:{port}", log)
    try:
        st.wait_ready()
        yield st
    finally:
        st.stop()
