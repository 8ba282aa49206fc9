"""The launcher's cache-aware flags reach the gateway's command line, and out-of-range values
are refused before anything starts (no replica, no gateway)."""

from __future__ import annotations

import argparse

import pytest

from mambaradix.cli import main as cli_main
from mambaradix.config import EngineConfig, ServerConfig, add_config_args, config_from_args
from mambaradix.server.replicas import ReplicaSet, ScaleOutConfig, config_args


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def gateway_cmd(so: ScaleOutConfig) -> list[str]:
    """The gateway's command line of ``serve_replicas`` (no process is started)."""
    rs = ReplicaSet(EngineConfig(model_path="tiny:qwen3_next"), ServerConfig(), so)
    rs.close()
    return rs.gateway_cmd()


def test_cache_aware_thresholds_reach_the_gateway():
    so = ScaleOutConfig(dp_size=2, router_balance_abs_threshold=5,
                        router_balance_rel_threshold=2.0, router_cache_threshold=0.6)  # fmt: skip
    cmd = gateway_cmd(so)
    assert flag(cmd, "--policy") == "cache_aware"
    assert flag(cmd, "--balance-abs-threshold") == "5"
    assert flag(cmd, "--balance-rel-threshold") == "2.0"
    assert flag(cmd, "--cache-threshold") == "0.6"
    default = gateway_cmd(ScaleOutConfig(dp_size=2))
    assert flag(default, "--balance-abs-threshold") == "8"  # not the gateway's 64
    so = ScaleOutConfig(dp_size=2, router_policy="round_robin")
    rr = gateway_cmd(so)
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


@pytest.mark.parametrize("cuda_graph_bs", [(), (1, 2, 4)], ids=["no-list", "list-flag"])
def test_replica_command_lines_rebuild_the_engine_config(cuda_graph_bs):
    """What the launcher passes each replica (``config_args``) parses back to the same engine
    config, a list flag included (an empty one is left out, not passed as ``()``)."""
    ecfg = EngineConfig(model_path="tiny:qwen3_next", page_size=16, cuda_graph_bs=cuda_graph_bs)
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    assert config_from_args(EngineConfig, parser.parse_args(config_args(ecfg))) == ecfg
