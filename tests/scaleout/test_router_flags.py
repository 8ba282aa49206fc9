"""The launcher's cache-aware flags reach the gateway's command line, and out-of-range values
are refused before anything starts (no replica, no gateway)."""

from __future__ import annotations

import pytest

from mambaradix.cli import main as cli_main
from mambaradix.config import EngineConfig, ServerConfig
from mambaradix.server.replicas import ReplicaSet, ScaleOutConfig


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cache_aware_thresholds_reach_the_gateway():
    so = ScaleOutConfig(dp_size=2, router_balance_abs_threshold=5,
                        router_balance_rel_threshold=2.0, router_cache_threshold=0.6)  # fmt: skip
    cmd = ReplicaSet(EngineConfig(model_path="tiny:qwen3_next"), ServerConfig(), so).gateway_cmd()
    assert flag(cmd, "--policy") == "cache_aware"
    assert flag(cmd, "--balance-abs-threshold") == "5"
    assert flag(cmd, "--balance-rel-threshold") == "2.0"
    assert flag(cmd, "--cache-threshold") == "0.6"
    default = ReplicaSet(EngineConfig(model_path="tiny:qwen3_next"), ServerConfig(),
                         ScaleOutConfig(dp_size=2)).gateway_cmd()  # fmt: skip
    assert flag(default, "--balance-abs-threshold") == "8"  # not the gateway's 64
    so = ScaleOutConfig(dp_size=2, router_policy="round_robin")
    rr = ReplicaSet(EngineConfig(model_path="tiny:qwen3_next"), ServerConfig(), so).gateway_cmd()
    assert flag(rr, "--policy") == "round_robin" and "--balance-abs-threshold" not in rr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--router-cache-threshold", "1.5"], "--router-cache-threshold must be in [0, 1]"),
        (["--router-balance-abs-threshold", "-1"], "--router-balance-abs-threshold must be >= 0"),
        (["--router-balance-rel-threshold", "0.5"], "--router-balance-rel-threshold must be >= 1"),
        (["--dp-size", "0"], "--dp-size must be >= 1"),
    ],
)
def test_bad_router_flags_are_refused_in_one_line(args, message, capsys):
    code = cli_main(["serve", "--model-path", "tiny:qwen3_next", "--dp-size", "2", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"mambaradix serve: error: {message}"
