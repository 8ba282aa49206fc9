"""The scale-out tests' stack: ``mambaradix serve --dp-size 2`` (two tiny replicas, one thread
each, behind the SGLang Model Gateway), real processes on 127.0.0.1, and what the tests read
of its processes (``/proc``). A module of its own (not ``conftest``, a name other test folders
use too) so that test modules import it by a name that is theirs alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mambaradix.server.ports import ReservedPort

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
    port: ReservedPort  # the gateway's, held until stop(): no other process takes it first
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
        self.port.close()


def start_stack(log: Path, *flags: str, env: dict[str, str] | None = None) -> Stack:
    """``serve --dp-size 2`` with ``REPLICA_FLAGS`` and ``flags``, output to ``log``; not yet
    ready (``wait_ready``). The gateway's port is reserved here and bound by the gateway."""
    port = ReservedPort()
    cmd = [sys.executable, "-m", "mambaradix.cli", "serve", *REPLICA_FLAGS,
           "--port", str(port.port), "--dp-size", "2", *flags]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return Stack(proc, f"http://127.0.0.1:{port.port}", log, port)
