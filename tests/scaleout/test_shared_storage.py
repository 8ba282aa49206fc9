"""``serve --dp-size 2`` gives its replicas one storage tier: a prefix one replica computed is
a hit, read from storage, on the other replica, which never saw it in RAM. One stack of two
tiny replicas behind the SGLang Model Gateway (round robin, so consecutive requests alternate
replicas); the tier is on because the replicas are more than one, not because of a flag. Plus
the launcher's choice itself (``shared_storage``), without processes: on, at one location for
every replica, unless ``--dp-private-cache`` or ``--disable-radix-cache``."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from scaleout_stack import API_KEY, AUTH, Stack, cmdline, start_stack

from mambaradix.bench.remote import read_counters
from mambaradix.cli import main as cli_main
from mambaradix.config import EngineConfig, ServerConfig
from mambaradix.kernels.native import cache_dir as kernel_cache_dir
from mambaradix.models.loader import cache_root
from mambaradix.server import replicas
from mambaradix.server.replicas import ReplicaSet, ScaleOutConfig, shared_storage

PROMPT = [3 + (i * 7919) % 500 for i in range(300)]  # token ids of the tiny model's vocab (512)
STORED_AT_LEAST = 256  # 300 tokens: at least the state at the last 64-token block boundary


def metric(url: str, name: str) -> float:
    """One of a replica's ``/metrics`` series (``mambaradix:<name>``, a counter's ``_total``
    included), summed over its labels; 0 when absent."""
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    pattern = re.compile(rf"^mambaradix:{name}(?:_total)?(?:\{{[^}}]*\}})? (\S+)$")
    return sum(float(m[1]) for line in text.splitlines() if (m := pattern.match(line)))


def generate(url: str) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = httpx.post(url + "/generate", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served_by(stack: Stack, before: dict[str, float]) -> str:
    """The replica whose prompt-token counter moved since ``before`` (it counts a request
    when the request finishes; polled in case the counter lags the response)."""
    deadline = time.monotonic() + 30
    while True:
        moved = [u for u in stack.replicas if read_counters(u, API_KEY)["prompt"] > before[u]]
        if moved or time.monotonic() > deadline:
            assert len(moved) == 1, f"served by {moved}"
            return moved[0]
        time.sleep(0.1)


def wait_written(url: str, timeout: float = 60.0) -> float:
    """Objects the replica wrote to storage, once some are and the count has stopped moving
    (write-through: staged at the snapshot insert, written right after by an I/O thread)."""
    deadline = time.monotonic() + timeout
    last, since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        n = metric(url, "storage_objects_written")
        if n != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since >= 0.5:
            return n
        time.sleep(0.1)
    raise AssertionError(f"{url} wrote {last} objects to storage within {timeout:.0f} s")


def test_a_prefix_computed_on_one_replica_is_a_storage_hit_on_the_other(tmp_path):
    # --hicache-storage-dir without --enable-hierarchical-cache: the tier is on by default for
    # --dp-size > 1. Tiny checkpoints and built kernels stay where they are.
    home = tmp_path / "home"
    home.mkdir()
    store = tmp_path / "store"
    env = dict(HOME=str(home), MAMBARADIX_CACHE=str(cache_root()),
               MAMBARADIX_KERNEL_CACHE=str(kernel_cache_dir()))  # fmt: skip
    log = tmp_path / "launcher.log"
    stack = start_stack(log, "--router-policy", "round_robin",
                        "--hicache-write-policy", "write_through",
                        "--hicache-storage-dir", str(store),
                        "--router-health-check-interval-secs", "600", env=env)  # fmt: skip
    proc = stack.proc
    try:
        stack.wait_ready()
        for url in stack.replicas:  # the launcher turned the tier on for each replica
            pid = stack.replica_pid(url)
            assert pid is not None
            line = cmdline(pid)
            assert "--enable-hierarchical-cache" in line, line
            assert f"--hicache-storage-dir {store} " in line, line

        before = {u: read_counters(u, API_KEY)["prompt"] for u in stack.replicas}
        first = generate(stack.url)
        computed_on = served_by(stack, before)
        other = next(u for u in stack.replicas if u != computed_on)
        assert first["meta_info"]["cached_tokens"] == 0  # nothing anywhere yet
        written = wait_written(computed_on)
        assert metric(other, "storage_objects_written") == 0  # it has not seen the prompt

        outs = [first]
        for i in range(1, 4):  # round robin: other, computed_on, other
            before = {u: read_counters(u, API_KEY)["prompt"] for u in stack.replicas}
            outs.append(generate(stack.url))
            assert served_by(stack, before) == (other if i % 2 else computed_on), i

        meta = outs[1]["meta_info"]  # the other replica, nothing in its RAM: from storage
        details = meta["cached_tokens_details"]
        assert meta["cached_tokens"] >= STORED_AT_LEAST, (meta, log.read_text()[-3000:])
        assert details["storage"] > 0, meta
        assert details["device"] + details["storage"] == meta["cached_tokens"], meta
        for out in outs[2:]:  # both replicas hold it in RAM now
            assert out["meta_info"]["cached_tokens"] >= STORED_AT_LEAST
            assert out["meta_info"]["cached_tokens_details"]["storage"] == 0, out["meta_info"]
        assert [o["output_ids"] for o in outs] == [first["output_ids"]] * len(outs)
        assert len(first["output_ids"]) == 2

        assert metric(other, "storage_hit_tokens") == details["storage"]
        assert metric(other, "storage_loads") >= 1
        assert metric(other, "storage_load_failures") == 0
        assert metric(computed_on, "storage_hit_tokens") == 0  # never needed storage
        for url, mine in ((computed_on, outs[0::2]), (other, outs[1::2])):  # the rest computed
            missed = sum(len(PROMPT) - o["meta_info"]["cached_tokens"] for o in mine)
            assert metric(url, "computed_prefill_tokens") == missed, url
        assert sum(1 for p in store.rglob("*") if p.is_file()) >= 1  # where the launcher said
        print(f"{written:.0f} objects written by {computed_on}; {other} read "
              f"{details['storage']} tokens from storage")  # fmt: skip
    finally:
        stack.stop()
    assert proc.returncode == 0


# ---------------------------------------------------------------------- the launcher's choice


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def replica_cmds(ecfg: EngineConfig, so: ScaleOutConfig) -> list[list[str]]:
    """The command lines ``serve_replicas`` would start (no process is started)."""
    rs = ReplicaSet(shared_storage(ecfg, so), ServerConfig(), so)
    rs.close()
    return [r.cmd for r in rs.replicas]


def test_replicas_share_one_storage_location_by_default(tmp_path, monkeypatch):
    so = ScaleOutConfig(dp_size=3)
    ecfg = EngineConfig(model_path="tiny:qwen3_next", hicache_storage_dir=str(tmp_path / "s"))
    shared = shared_storage(ecfg, so)
    assert shared.enable_hierarchical_cache and not ecfg.enable_hierarchical_cache  # a copy
    shared.validate()
    cmds = replica_cmds(ecfg, so)
    assert len(cmds) == 3
    assert all("--enable-hierarchical-cache" in c for c in cmds)
    assert {flag(c, "--hicache-storage-dir") for c in cmds} == {str(tmp_path / "s")}

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # '' takes ~/.cache/mambaradix/hicache
    default = shared_storage(EngineConfig(model_path="tiny:qwen3_next"), so)
    assert default.enable_hierarchical_cache
    assert default.hicache_storage_dir == str(tmp_path / "home/.cache/mambaradix/hicache")
    tilde = EngineConfig(model_path="tiny:qwen3_next", hicache_storage_dir="~/s")
    tilde = shared_storage(tilde, so)
    assert tilde.hicache_storage_dir == str(tmp_path / "home/s")  # not "~" in each replica
    for c in replica_cmds(EngineConfig(model_path="tiny:qwen3_next"), so):
        dirs = flag(c, "--hicache-storage-dir")
        assert dirs is not None and Path(dirs).is_absolute()

    redis = EngineConfig(model_path="tiny:qwen3_next", hicache_storage_backend="redis")
    for c in replica_cmds(redis, so):  # one server for all (the default URL)
        assert "--enable-hierarchical-cache" in c and flag(c, "--hicache-storage-dir") is None


@pytest.mark.parametrize(
    "ecfg, so",
    [
        (EngineConfig(model_path="tiny:qwen3_next"), ScaleOutConfig(2, dp_private_cache=True)),
        (EngineConfig(model_path="tiny:qwen3_next", disable_radix_cache=True), ScaleOutConfig(2)),
    ],
    ids=["dp-private-cache", "disable-radix-cache"],
)
def test_no_shared_tier_when_private_or_without_radix_cache(ecfg, so):
    assert shared_storage(ecfg, so) == ecfg
    for c in replica_cmds(ecfg, so):
        assert "--enable-hierarchical-cache" not in c and "--hicache-storage-dir" not in c


def test_a_tier_the_user_configured_is_kept(tmp_path):
    ecfg = EngineConfig(
        model_path="tiny:qwen3_next",
        enable_hierarchical_cache=True,
        hicache_storage_dir=str(tmp_path),
        hicache_write_policy="write_back",
    )
    assert shared_storage(ecfg, ScaleOutConfig(2)) == ecfg


def test_storage_dir_flag_with_dp_size(tmp_path, monkeypatch, capsys):
    """``serve --dp-size 2 --hicache-storage-dir DIR`` names where the replicas' default tier
    goes; nothing is started (``serve_replicas`` is replaced)."""
    seen: list[EngineConfig] = []

    def fake_serve_replicas(ecfg: EngineConfig, scfg: ServerConfig, so: ScaleOutConfig) -> int:
        seen.append(shared_storage(ecfg, so))
        return 0

    monkeypatch.setattr(replicas, "serve_replicas", fake_serve_replicas)
    code = cli_main(["serve", "--model-path", "tiny:qwen3_next", "--dp-size", "2",
                     "--hicache-storage-dir", str(tmp_path)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert seen[0].enable_hierarchical_cache and seen[0].hicache_storage_dir == str(tmp_path)
