"""What the OpenAI routes (``app.py``) and SGLang's ``/generate`` (``native.py``) share: a
request's sampling fields in, the engine's events out.

- Parameters: ``openai_params`` (OpenAI / vLLM field names) and ``native_params`` (SGLang's
  ``sampling_params``) side by side, read the same way: ``stop_strings``, and ``checked``,
  which turns ``SamplingParams.validate``'s ``FieldError`` into a 400 naming the field in the
  API's own words. The output grammar comes from ``server.structured``.
- Replies, once the jobs are submitted: ``collect`` (whole: waits for every job) or
  ``sse_response`` (``text/event-stream``: the route's ``frames`` turn each engine event into
  ``data:`` lines, ``sse`` / ``SSE_DONE``). Either way the request counts in ``srv.active``
  (graceful shutdown waits for it) until it ends, and a client that goes away has its
  unfinished requests aborted in the engine (which frees their slots) and counted as aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from mambaradix.core import MAX_TOP_LOGPROBS, FieldError, SamplingParams
from mambaradix.server.guard import read_body
from mambaradix.server.jobs import Job
from mambaradix.server.protocol import MAX_N, APIError
from mambaradix.server.structured import grammar_of
from mambaradix.server.validation import parse_json

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2
SSE_DONE = "data: [DONE]\n\n"
_OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams' name -> OpenAI's

Events = AsyncIterator[tuple[Job, Any]]  # (job, its RequestOutput or the exception it raised)


async def read_json(srv: Any, request: Any) -> Any:
    """The body as JSON whatever its content type (curl -d sends form encoding), through the
    size, UTF-8, syntax, depth and surrogate checks."""
    return parse_json(await read_body(request, srv.max_body))


# --------------------------------------------------------------------------- parameters


def stop_strings(stop: str | list[str] | None, where: str | None = None) -> list[str]:
    """``stop`` as a list; an empty stop string is a 400 (``where`` leads its message)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        why = "stop strings must not be empty"
        raise APIError(f"{where}: {why}" if where else why, param="stop")
    return stops


def checked(
    params: SamplingParams,
    vocab_size: int | None,
    prefix: str = "",
    names: dict[str, str] | None = None,
) -> SamplingParams:
    """``params`` validated; a bad one is a 400 whose param is ``prefix`` + the API's name for
    the field (``names``: ``SamplingParams``' name -> the API's, where they differ)."""
    try:
        params.validate(vocab_size)
    except FieldError as e:
        field = (names or {}).get(e.field, e.field)
        raise APIError(prefix + str(e), param=prefix + field) from None
    return params


def openai_params(req: Any, max_new_tokens: int, vocab_size: int) -> SamplingParams:
    """The engine's parameters of an OpenAI request (``protocol._SamplingFields``; null means
    the default); a 400 names OpenAI's field. The grammar is the route's (``grammar_of``)."""
    n = req.num_choices
    if not 1 <= n <= MAX_N:
        raise APIError(f"n must be in [1, {MAX_N}], got {n}", param="n")
    stop = stop_strings(req.stop)
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        skip_special_tokens=req.skip_special_tokens is not False,
        logit_bias=_logit_bias(req.logit_bias),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens or 0,
    )
    if params.temperature > 2.0:
        raise APIError(
            f"temperature must be in [0, 2], got {params.temperature}", param="temperature"
        )
    return checked(params, vocab_size, names=_OPENAI_NAMES)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise APIError(
                f"logit_bias keys must be token ids (decimal strings), got {key!r}",
                param="logit_bias",
            ) from None
        out[tok] = float(value)
    return out


def native_params(sp: Any, max_new_tokens: int, opts: Any, prompt_len: int) -> SamplingParams:
    """The engine's parameters of one ``/generate`` prompt of ``prompt_len`` tokens: its
    ``sampling_params`` (``native_protocol.NativeSampling``) and logprob options
    (``PromptOptions``). SGLang's ``logprob_start_len`` s (-1: the prompt's last token) asks for
    the logprobs of prompt tokens s+1 .. L-1 (token s itself is reported without one): the
    engine's ``prompt_logprob_start`` s+1; ``top_logprobs_num`` alternatives per token of both.
    A 400 names SGLang's field."""
    return_logprob = opts.return_logprob
    start, top_n = opts.logprob_start_len, opts.top_logprobs_num
    if return_logprob and start != -1 and not 0 <= start < prompt_len:
        raise APIError(
            f"logprob_start_len must be -1 or in [0, {prompt_len}) (the prompt's "
            f"{prompt_len} tokens), got {start}",
            param="logprob_start_len",
        )
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise APIError(
            f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}",
            param="top_logprobs_num",
        )
    wants_prompt = return_logprob and start != -1 and start + 1 < prompt_len
    stop = stop_strings(sp.stop, "sampling_params.stop")
    if not 1 <= sp.n <= 16:
        raise APIError(f"sampling_params.n must be in [1, 16], got {sp.n}", param="n")
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.sampling_seed,
        ignore_eos=sp.ignore_eos,
        stop=stop,
        stop_token_ids=list(sp.stop_token_ids or []),
        return_logprob=return_logprob,
        skip_special_tokens=sp.skip_special_tokens,
        top_logprobs=top_n if return_logprob else 0,
        prompt_logprob_start=start + 1 if wants_prompt else -1,
        prompt_top_logprobs=top_n if wants_prompt else 0,
        grammar=grammar_of(sp, prefix="sampling_params."),
    )
    return checked(params, None, prefix="sampling_params.")


# --------------------------------------------------------------------------- replies


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def collect(srv: Any, request: Any, jobs: list[Job]) -> None:
    """Wait until every submitted job has finished (each accumulates its events); a client that
    goes away meanwhile has them aborted. Raises the 500 of a job the engine failed."""
    srv.active += 1
    watcher = asyncio.create_task(watch_disconnect(request, srv.engine, jobs))
    try:
        await asyncio.gather(*(job.collect() for job in jobs))
    finally:
        srv.active -= 1
        watcher.cancel()
        abort_unfinished(srv.engine, jobs)
    err = first_error(jobs)
    if err is not None:
        raise err


def sse_response(
    srv: Any, jobs: list[Job], frames: Callable[[Events], AsyncIterator[str]]
) -> StreamingResponse:
    """The submitted jobs as an event stream: ``frames(events)`` gets each engine event of every
    job as it comes (``events`` ends when all have finished; an exception is its job's last
    event) and yields the route's ``data:`` lines, its ``[DONE]`` included. When the frames
    end, or the client goes away (the stream cancelled or closed), the pumps stop and what is
    unfinished is aborted."""
    srv.active += 1
    return StreamingResponse(_stream(srv, jobs, frames), media_type="text/event-stream")


async def _stream(
    srv: Any, jobs: list[Job], frames: Callable[[Events], AsyncIterator[str]]
) -> AsyncIterator[str]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(job.pump(queue)) for job in jobs]
    try:
        async with contextlib.aclosing(frames(_events(queue, len(jobs)))) as lines:
            async for line in lines:
                yield line
    finally:
        srv.active -= 1
        for t in tasks:
            t.cancel()
        abort_unfinished(srv.engine, jobs)


async def _events(queue: asyncio.Queue, n_jobs: int) -> Events:
    remaining = n_jobs
    while remaining:
        job, out = await queue.get()
        if isinstance(out, BaseException) or out.finished:
            remaining -= 1
        yield job, out


def first_error(jobs: list[Job]) -> APIError | None:
    for job in jobs:
        if job.error is not None:
            return APIError(f"engine error: {job.error}", 500, "server_error")
    return None


def abort_unfinished(engine: Any, jobs: list[Job]) -> None:
    """Abort in the engine what the client no longer waits for, and count it as aborted (the
    engine's final event for it reaches nobody)."""
    for job in jobs:
        if not job.finished:
            engine.abort(job.rid)
            if job.timer is not None:
                job.timer.aborted()


async def watch_disconnect(request: Any, engine: Any, jobs: list[Job]) -> None:
    """Poll the connection of a non-streaming request; abort its jobs when the client is gone."""
    while True:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if await request.is_disconnected():
            logger.info("client disconnected; aborting %d request(s)", len(jobs))
            for job in jobs:
                if not job.finished:
                    engine.abort(job.rid)
            return
