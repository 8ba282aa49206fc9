"""Sending a workload: the request record, the in-process engine backend and the player.

A backend streams every request (greedy, ``ignore_eos``, fixed output length) and records
TTFT, inter-token gaps, end-to-end latency, prompt / output / cached token counts and the output
ids (the multi-turn workload resends them): ``EngineBackend`` here, ``bench.remote.
RemoteBackend`` for any server or router over HTTP. ``run_workload`` plays the workload with a
request rate (infinite or Poisson arrivals of sessions) and a cap on requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from mambaradix.bench.workloads import Workload
from mambaradix.core import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestResult:
    session: int = 0
    turn: int = 0
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    storage_tokens: int = 0  # of cached_tokens, read back from the storage tier
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    success: bool = False
    error: str = ""


class _Timing:
    """Per-request clock: ``tokens(n)`` at every chunk that carries n new tokens."""

    __slots__ = ("t0", "last", "ttft", "itls")

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.last: float | None = None
        self.ttft = 0.0
        self.itls: list[float] = []

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.t0
            self.itls.extend([0.0] * (n - 1))
        else:
            self.itls.extend([(now - self.last) / n] * n)
        self.last = now

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


class EngineBackend:
    """Streams requests through ``engine.submit(...).aevents()`` in this process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(self, input_ids: list[int], output_len: int) -> RequestResult:
        res = RequestResult(prompt_ids=list(input_ids), prompt_len=len(input_ids))
        params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        timing = _Timing()
        try:
            handle = self.engine.submit(list(input_ids), params)
            async for out in handle.aevents():
                timing.tokens(len(out.new_token_ids))
                res.output_ids.extend(out.new_token_ids)
                res.cached_tokens = max(0, out.cached_tokens)
                res.storage_tokens = out.storage_tokens
                if out.finished:
                    res.success = out.finish_reason != "abort"
                    if not res.success:
                        res.error = "aborted"
        except Exception as e:  # a failed request is reported, not fatal
            res.error = f"{type(e).__name__}: {e}"
        res.latency, res.ttft, res.itls = timing.elapsed(), timing.ttft, timing.itls
        res.output_len = len(res.output_ids)
        return res

    async def aclose(self) -> None:
        return None


async def run_workload(
    workload: Workload,
    backend: Any,
    request_rate: float = float("inf"),
    max_concurrency: int = 0,
    seed: int = 0,
    progress: Any = None,
) -> tuple[list[RequestResult], float]:
    """Play ``workload``; returns the results in issue order and the duration in seconds.

    Sessions start at the request rate (Poisson, or all at once when infinite); a session's
    turns follow one another, each sent when the previous one finished. At most
    ``max_concurrency`` requests are in flight (0 = no cap).
    """
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    rng = random.Random(seed)
    results: list[RequestResult] = []
    t_start = time.perf_counter()

    async def run_session(index: int) -> None:
        prompt: list[int] = []
        prev_out: list[int] = []
        for k, turn in enumerate(workload.sessions[index].turns):
            if k and len(prev_out) == 0:
                logger.error("session %d: no output ids from turn %d; stopping it", index, k - 1)
                return
            prompt = prompt + prev_out + turn.new_ids
            if sem is not None:
                async with sem:
                    start = time.perf_counter() - t_start
                    res = await backend.generate(prompt, turn.output_len)
            else:
                start = time.perf_counter() - t_start
                res = await backend.generate(prompt, turn.output_len)
            res.session, res.turn, res.start = index, k, start
            results.append(res)
            if progress is not None:
                progress.update(1)
            if not res.success:
                logger.warning("request failed (session %d turn %d): %s", index, k, res.error)
                return
            prev_out = res.output_ids

    tasks = []
    for i in range(len(workload.sessions)):
        tasks.append(asyncio.create_task(run_session(i)))
        if request_rate != float("inf") and i + 1 < len(workload.sessions):
            await asyncio.sleep(rng.expovariate(request_rate))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t_start
    results.sort(key=lambda r: r.start)
    return results, duration
