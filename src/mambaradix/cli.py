"""The ``mambaradix`` command: ``serve``, ``bench`` and ``generate``.

Flags are generated from the config dataclasses (``EngineConfig``, ``ServerConfig``,
``BenchConfig``, ``GenerateConfig``), with SGLang's names where the meaning is the same::

    mambaradix serve --model-path tiny:qwen3_next --port 30000
    mambaradix serve --model-path tiny:qwen3_next --port 30000 --dp-size 2
    mambaradix bench --model-path tiny:qwen3_next:small --compare-cache
    mambaradix bench --base-url http://127.0.0.1:30000 --dataset-name multi-turn
    mambaradix generate --model-path tiny:qwen3_next --prompt "Hello" --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass

from mambaradix.bench.runner import DEFAULT_MODEL, BenchConfig, run_benchmark
from mambaradix.config import EngineConfig, ServerConfig, add_config_args, config_from_args, opt
from mambaradix.server.replicas import ScaleOutConfig

logger = logging.getLogger(__name__)

_LEVELS = ["debug", "info", "warning", "error"]


@dataclass
class GenerateConfig:
    prompt: str = opt("Hello, my name is", "Prompt text.")
    chat: bool = opt(False, "Wrap the prompt as one user message in the chat template.")
    max_new_tokens: int = opt(32, "Tokens to generate.")
    temperature: float = opt(0.0, "Sampling temperature (0 = greedy).")
    top_p: float = opt(1.0, "Nucleus sampling.")
    top_k: int = opt(-1, "Top-k sampling (-1 = off).")
    min_p: float = opt(0.0, "Min-p sampling.")
    ignore_eos: bool = opt(False, "Keep generating after EOS.")
    log_level: str = opt("warning", "Log level.", _LEVELS)


@dataclass
class BenchLogConfig:
    log_level: str = opt("warning", "Log level.", _LEVELS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mambaradix", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="Serve an OpenAI-compatible HTTP API.")
    add_config_args(p, EngineConfig)
    add_config_args(p, ServerConfig)
    add_config_args(p, ScaleOutConfig)
    p = sub.add_parser("bench", help="Benchmark a server or an in-process engine.")
    add_config_args(p, EngineConfig)
    add_config_args(p, BenchConfig)
    add_config_args(p, BenchLogConfig)
    p = sub.add_parser("generate", help="Generate a completion offline (in-process engine).")
    add_config_args(p, EngineConfig)
    add_config_args(p, GenerateConfig)
    return parser


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _engine_config(ns: argparse.Namespace, so: ScaleOutConfig | None = None) -> EngineConfig:
    ecfg = config_from_args(EngineConfig, ns)
    if not ecfg.model_path:
        logger.info("no --model-path: using the built-in %s", DEFAULT_MODEL)
        ecfg = dataclasses.replace(ecfg, model_path=DEFAULT_MODEL)
    if so is not None and so.dp_size > 1:  # replicas share a storage tier by default
        from mambaradix.server.replicas import shared_storage

        ecfg = shared_storage(ecfg, so)
    ecfg.validate()
    return ecfg


def _serve(ns: argparse.Namespace) -> int:
    from mambaradix.engine.engine import Engine
    from mambaradix.server.launch import serve
    from mambaradix.server.lifecycle import bind_socket

    scfg = config_from_args(ServerConfig, ns)
    scfg.validate()
    _logging(scfg.log_level)
    so = config_from_args(ScaleOutConfig, ns)
    so.validate()
    if so.dp_size > 1:  # N replicas behind the SGLang Model Gateway (server/replicas.py)
        from mambaradix.server.replicas import serve_replicas

        return serve_replicas(_engine_config(ns, so), scfg, so)
    ecfg = _engine_config(ns)
    sock = bind_socket(scfg.host, scfg.port)  # a port in use fails now, not after loading
    with Engine(ecfg) as engine:
        code = serve(engine, scfg, sock=sock)
    return code


def _bench(ns: argparse.Namespace) -> int:
    _logging(ns.log_level)
    bcfg = config_from_args(BenchConfig, ns)
    ecfg = config_from_args(EngineConfig, ns)
    if not bcfg.base_url:
        ecfg = _engine_config(ns)
    elif bcfg.compare_cache:
        raise SystemExit(
            "--compare-cache runs in-process engines; against servers use --compare-base-url "
            "with a second server started with --disable-radix-cache"
        )
    report = run_benchmark(bcfg, ecfg)
    failed = report["results"]["failed"] + report.get("cache_off", {}).get("failed", 0)
    return 1 if failed else 0


def _generate(ns: argparse.Namespace) -> int:
    from mambaradix.engine.engine import Engine

    gcfg = config_from_args(GenerateConfig, ns)
    _logging(gcfg.log_level)
    params = {
        "max_new_tokens": gcfg.max_new_tokens,
        "temperature": gcfg.temperature,
        "top_p": gcfg.top_p,
        "top_k": gcfg.top_k,
        "min_p": gcfg.min_p,
        "ignore_eos": gcfg.ignore_eos,
    }
    with Engine(_engine_config(ns)) as engine:
        prompt = gcfg.prompt
        if gcfg.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        ids = engine.tokenizer.encode(prompt, add_special_tokens=not gcfg.chat)
        out = engine.generate(input_ids=ids, sampling_params=params)
    sys.stdout.write(out["text"] + "\n")
    sys.stderr.write(json.dumps(out["meta_info"], default=str) + "\n")
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user asked for something wrong: one line, exit 2."""
    from mambaradix.server.lifecycle import PortInUseError

    return (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, PortInUseError)


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user error (bad path, missing file, unsupported architecture, port
    in use, CUDA asked on a CPU build, a bad flag value) prints one line and returns 2 (the
    traceback only with --log-level debug)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    handler = {"serve": _serve, "bench": _bench, "generate": _generate}[ns.command]
    try:
        return handler(ns)
    except _user_errors() as e:
        if getattr(ns, "log_level", "") == "debug":
            logger.exception("user error")
        message = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        if isinstance(e, FileNotFoundError | NotADirectoryError) and e.filename:
            message = f"{e.strerror}: {e.filename}"
        sys.stderr.write(f"mambaradix {ns.command}: error: {message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
