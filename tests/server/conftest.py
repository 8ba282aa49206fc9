"""One real engine on the built-in tiny Qwen3-Next, served in-process on a free port."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mambaradix.config import ServerConfig  # noqa: E402
from mambaradix.engine.engine import Engine  # noqa: E402
from mambaradix.server.launch import ServerThread  # noqa: E402


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    eng = Engine(
        model_path="tiny:qwen3_next",
        max_total_tokens=16384,
        max_mamba_cache_size=96,
        chunked_prefill_size=256,
        debug_integrity=True,  # the full check after every engine step
    )
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: Engine) -> Iterator[ServerThread]:
    with ServerThread(engine, ServerConfig(port=0, served_model_name="tiny-qwen")) as st:
        yield st


@pytest.fixture()
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture()
def wait_idle(engine):
    """Call to block until the engine is idle (fails after ``timeout`` seconds)."""

    def wait(timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not engine.is_idle():
            assert time.monotonic() < deadline, "engine did not become idle"
            time.sleep(0.02)

    return wait


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own model of the served tiny checkpoint: the logprob oracle."""
    from transformers import AutoModelForCausalLM

    from mambaradix.models.loader import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path("tiny:qwen3_next"), dtype=torch.float32
    ).eval()
