"""The serving process: SIGTERM with streams in flight ends within the timeout with a final
event on every stream and exit 0; an engine fault turns /health to 503 and ends the process
with a non-zero exit (a supervisor restarts it). Each test runs ``mambaradix serve`` in a child
process on the tiny model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from serve_child import FAULT_PROMPT  # noqa: E402

# --debug-integrity: the full check after every engine step of the served engine
FLAGS = ["--model-path", "tiny:qwen3_next", "--skip-warmup", "--max-total-tokens", "8192",
         "--max-mamba-cache-size", "32", "--log-level", "info", "--debug-integrity"]  # fmt: skip
GRACE_S = 5.0
DEADLINE_S = 60.0  # for conditions polled on a loaded 2-core machine


def _start(*extra: str, fault: bool = False) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    src = os.path.join(HERE, "..", "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), env.get("PYTHONPATH", "")])
    with socket.socket() as listen:  # bound here on port 0 and handed over: no port race
        listen.bind(("127.0.0.1", 0))
        port = listen.getsockname()[1]
        cmd = [sys.executable, os.path.join(HERE, "serve_child.py")]
        cmd += ["--fault"] if fault else []
        cmd += ["--listen-fd", str(listen.fileno()), *FLAGS, "--port", str(port), *extra]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                pass_fds=[listen.fileno()])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def _stream(url: str, events: list, started: threading.Event) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True,
            "temperature": 0}  # fmt: skip
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) >= 3:
                        started.set()
    except httpx.HTTPError as e:
        events.append(f"transport error: {e!r}")
    started.set()


def test_sigterm_drains_then_aborts_streams_and_exits_0() -> None:
    proc, url = _start("--graceful-shutdown-timeout", str(GRACE_S))
    try:
        streams = [([], threading.Event()) for _ in range(3)]
        threads = [threading.Thread(target=_stream, args=(url, ev, st)) for ev, st in streams]
        for t in threads:
            t.start()
        for _, st in streams:
            assert st.wait(60)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # draining: admission stopped, health says so (once the signal is handled), the
        # streams keep going
        while (health := httpx.get(url + "/health", timeout=5).status_code) != 503:
            assert health == 200, health
            assert time.monotonic() - t0 < DEADLINE_S, "/health never turned 503 on SIGTERM"
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=5)
        assert r.status_code == 503
        for t in threads:
            t.join(timeout=GRACE_S + DEADLINE_S)
        rc = proc.wait(timeout=GRACE_S + DEADLINE_S)
        elapsed = time.monotonic() - t0
        out = proc.stdout.read().decode()
        assert rc == 0, out
        # ended by the timeout, not by the streams running out (they end with "abort" below)
        assert elapsed < GRACE_S + DEADLINE_S, elapsed
        for events, _ in streams:
            assert events[-1] == "[DONE]", events[-3:]
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "abort", last
            assert len(events) > 5  # it kept streaming during the grace period
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_engine_fault_turns_health_503_and_exits_nonzero() -> None:
    proc, url = _start(fault=True)
    try:
        ok = httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2},
                        timeout=30)  # fmt: skip
        assert ok.status_code == 200
        body = {"prompt": FAULT_PROMPT + [1, 2], "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "injected forward fault" in r.text, r.text
        try:
            health = httpx.get(url + "/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # already gone: also never 200
        assert health in (503, None)
        rc = proc.wait(timeout=DEADLINE_S)
        out = proc.stdout.read().decode()
        assert rc != 0, out
        assert out.count("Traceback") == 1, out  # the fault is logged once, with its traceback
        assert "injected forward fault" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("extra", [["--model-path", "/nonexistent/m"]])
def test_cli_user_error_is_one_line_exit_2(extra) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    src = os.path.abspath(os.path.join(HERE, "..", "..", "src"))
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "mambaradix.cli", "serve", *FLAGS, *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("mambaradix serve: error:")


def _user_error_cases(tmp_path) -> list[tuple[str, list[str], str]]:
    unknown = tmp_path / "unknown_arch"
    unknown.mkdir()
    (unknown / "config.json").write_text(
        '{"architectures": ["FooForCausalLM"], "model_type": "llama"}'
    )
    empty = tmp_path / "no_config"
    empty.mkdir()
    return [
        ("bad path", ["--model-path", str(tmp_path / "missing")], "not a folder"),
        ("missing file", ["--model-path", str(empty)], "config.json"),
        ("unsupported architecture", ["--model-path", str(unknown)], "unsupported architecture"),
        ("CUDA on a CPU build", ["--model-path", "tiny:qwen3_next", "--device", "cuda"], "cuda"),
        ("bad flag value", ["--model-path", "tiny:qwen3_next", "--page-size", "0"], "page-size"),
        ("bad metrics prefix", ["--metrics-prefix", "a-b"], "metrics-prefix"),
    ]  # fmt: skip


def test_every_cli_user_error_is_one_line_exit_2_in_process(tmp_path, capsys) -> None:
    import socket

    from mambaradix.cli import main

    for name, args, needle in _user_error_cases(tmp_path):
        # port 0: the OS picks a free port at bind time (a port chosen earlier may be taken)
        assert main(["serve", *args, "--port", "0"]) == 2, name
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and "Traceback" not in err, (name, err)
        assert needle in lines[0].lower() or needle in lines[0], (name, lines[0])
    with socket.socket() as taken:  # port in use: refused before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", "--model-path", "tiny:qwen3_next", "--port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already in use" in err, err
