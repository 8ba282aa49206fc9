"""SGLang's native HTTP API beside the OpenAI one: same paths, fields and response shapes, so
SGLang clients (``bench_serving --backend sglang``, cache-flush tooling) and the SGLang Model
Gateway (``sglang-router``: registration, load polling, cache flush) work against us.

Routes (``native_router(srv)``, included by ``create_app``):

- ``POST /generate``: ``text`` or ``input_ids`` (one or a batch), ``sampling_params``,
  ``stream`` (``data: {...}`` lines with the cumulative ``text`` / ``output_ids``, then
  ``data: [DONE]``), ``return_logprob`` (+ ``logprob_start_len``, ``top_logprobs_num``),
  ``rid``; answers ``text``, ``output_ids``, ``meta_info`` (``id``, ``finish_reason``,
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``e2e_latency``; with
  ``return_logprob``: ``input_token_logprobs``, ``output_token_logprobs`` and the
  ``*_top_logprobs``);
- ``GET /get_model_info`` (``/model_info``), ``GET /get_server_info`` (``/server_info``),
  ``GET /get_load`` (a list with one entry per data-parallel rank, as the gateway sums it),
  ``GET|POST /flush_cache`` (200 when the tree was emptied, 400 while requests run or wait),
  ``POST /tokenize`` / ``/detokenize`` (also under ``/v1``), ``GET /version``.

All of them sit behind ``--api-key`` (SGLang leaves only ``/health*`` and ``/metrics`` open).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse

import mambaradix
from mambaradix.engine.outputs import spec_meta
from mambaradix.server.jobs import Choices, Job
from mambaradix.server.native_protocol import (
    DetokenizeRequest,
    GenerateRequest,
    PromptOptions,
    TokenizeRequest,
    finish_reason,
    logprob_meta,
)
from mambaradix.server.protocol import APIError, error_body
from mambaradix.server.serving import (
    SSE_DONE,
    Events,
    collect,
    native_params,
    read_json,
    sse,
    sse_response,
)

logger = logging.getLogger(__name__)


class _NativeJob:
    """One engine request of a /generate call and what SGLang reports about it."""

    __slots__ = ("job", "t0", "opts", "with_text")

    def __init__(self, job: Job, t0: float, opts: PromptOptions, with_text: bool):
        self.job = job
        self.t0 = t0
        self.opts = opts
        self.with_text = with_text

    def body(self) -> dict[str, Any]:
        job = self.job
        meta: dict[str, Any] = {
            "id": job.rid,
            "finish_reason": finish_reason(
                job.finish_reason, job.finish_matched, len(job.token_ids)
            ),
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.completion_tokens,
            "cached_tokens": job.cached_tokens,
            "cached_tokens_details": {
                "device": job.cached_tokens - job.storage_tokens,
                "storage": job.storage_tokens,
            },
            "e2e_latency": time.perf_counter() - self.t0,
            **spec_meta(job.spec_verify_ct, job.spec_accepted),
        }
        if self.opts.return_logprob:
            decode = (lambda t: job.ch.tok.decode([t])) if self.with_text else None
            meta.update(
                logprob_meta(
                    job.input_ids,
                    self.opts.logprob_start_len,
                    self.opts.top_logprobs_num,
                    (job.token_ids, job.logprobs, job.tops),
                    (job.prompt_lps, job.prompt_tops),
                    decode,
                )
            )
        return {
            "text": "".join(job.text_parts),
            "output_ids": list(job.token_ids),
            "meta_info": meta,
        }


def keyed_router(srv: Any) -> APIRouter:
    """A router whose every route needs ``Authorization: Bearer <--api-key>`` (when one is set);
    the native and debug routes share it."""

    async def require_key(request: Request) -> None:
        key = srv.cfg.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            raise APIError("invalid or missing API key", 401, code="invalid_api_key")

    return APIRouter(dependencies=[Depends(require_key)])


def native_router(srv: Any) -> APIRouter:
    """The SGLang-native routes over the app's shared state ``srv`` (``app._Server``)."""
    engine = srv.engine

    router = keyed_router(srv)

    @router.post("/generate", response_model=None)
    async def generate(request: Request) -> Any:
        req = await _parse(srv, request, GenerateRequest)
        srv.check_admitting()
        req.check_fields()
        srv.check_model(req.model)
        prompts, batch = req.prompts()
        t0 = time.perf_counter()
        tok = engine.tokenizer
        ch = Choices(chat=False, req=req, tok=tok, table=srv.table)  # text and token bookkeeping
        njobs: list[_NativeJob] = []
        for p_idx, (prompt, opts) in enumerate(zip(prompts, req.per_prompt(len(prompts)))):
            ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
            srv.check_ids(ids)
            sp, rid = opts.sampling, opts.rid
            max_new = srv.max_tokens_for(len(ids), sp.max_new_tokens)
            params = native_params(sp, max_new, opts, len(ids))
            for j in range(sp.n):
                job = Job.make(len(njobs), ids, params, j, ch, prompt_key=p_idx)
                if rid is not None:
                    job.rid = rid if sp.n == 1 else f"{rid}-{j}"
                njobs.append(_NativeJob(job, t0, opts, req.return_text_in_logprobs))
        multi = batch or len(njobs) > 1
        jobs = [nj.job for nj in njobs]
        _submit(srv, jobs, custom_rids=any(r is not None for r in req.rid_list()))
        if req.stream:
            return sse_response(srv, jobs, lambda events: _frames(njobs, multi, events))
        await collect(srv, request, jobs)  # a request failed in the engine: a 500 with the reason
        bodies = [nj.body() for nj in njobs]
        return bodies if multi else bodies[0]

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return _model_info(srv)

    @router.get("/get_server_info")
    @router.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return _server_info(srv)

    @router.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [_load(engine)]

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        busy, freed = await asyncio.to_thread(engine.call, lambda: _flush(engine))
        if freed is None:
            return PlainTextResponse(
                f"Cache not flushed: {busy} request(s) running or waiting hold it; "
                "retry when the server is idle.\n",
                status_code=400,
            )
        return PlainTextResponse(f"Cache flushed: {freed} cached tokens freed.\n")

    async def clear_storage() -> JSONResponse:
        """Empty the storage tier (``/flush_cache`` empties only the RAM tier)."""
        tier = engine.cache.storage
        if tier is None:
            return JSONResponse(
                "Hierarchical cache storage is not enabled (--enable-hierarchical-cache).",
                status_code=400,
            )
        removed = await asyncio.to_thread(tier.clear_storage)
        logger.info("storage tier cleared: %d objects removed", removed)
        return JSONResponse("Hierarchical cache storage backend cleared.")

    router.add_api_route("/hicache/storage-backend/clear", clear_storage, methods=["POST"])
    router.add_api_route("/clear_hicache_storage_backend", clear_storage, methods=["GET", "POST"])

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await _parse(srv, request, TokenizeRequest)
        srv.check_model(req.model)
        texts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        toks = [
            engine.tokenizer.encode(t, add_special_tokens=req.add_special_tokens) for t in texts
        ]
        one = isinstance(req.prompt, str)
        return {
            "tokens": toks[0] if one else toks,
            "count": len(toks[0]) if one else [len(t) for t in toks],
            "max_model_len": engine.context_length,
        }

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(srv, request, DetokenizeRequest)
        srv.check_model(req.model)
        one = not req.tokens or isinstance(req.tokens[0], int)
        seqs = [req.tokens] if one else list(req.tokens)
        for seq in seqs:
            srv.check_ids(seq)  # type: ignore[arg-type]
        texts = [
            engine.tokenizer.decode(s, skip_special_tokens=req.skip_special_tokens) for s in seqs
        ]
        return {"text": texts[0] if one else texts}

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": mambaradix.__version__}

    return router


# --------------------------------------------------------------------------- helpers


async def _parse(srv: Any, request: Request, model: type) -> Any:
    """The body through the app's checks (size, UTF-8, JSON, depth, lone surrogates), then
    SGLang's schema (``native_protocol``: its own table of fields accepted at defaults)."""
    from pydantic import ValidationError

    from mambaradix.server.validation import pydantic_error

    data = await read_json(srv, request)
    if not isinstance(data, dict):
        raise APIError(f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise pydantic_error(e.errors()) from None


def _submit(srv: Any, jobs: list[Job], custom_rids: bool) -> None:
    """Submit all jobs or none; with client-chosen rids, one by one under those ids."""
    if not custom_rids:
        srv.submit(jobs)
        return
    rids = [job.rid for job in jobs]
    clash = next((r for r in rids if srv.engine.has_request(r)), None)
    if clash is not None or len(set(rids)) != len(rids):
        raise APIError(f"rid {clash or rids[0]!r} is already in use", param="rid")
    srv.submit(jobs, keep_rids=True)


async def _frames(njobs: list[_NativeJob], multi: bool, events: Events) -> AsyncIterator[str]:
    """SGLang's stream: one ``data:`` line per engine event that brings tokens (non-incremental:
    the text and output ids so far), with ``index`` in a batch; ``[DONE]`` at the end. A
    request failed in the engine is an error line, then ``[DONE]``; an exception of the engine
    ends the stream after its error line."""
    by_job = {id(nj.job): nj for nj in njobs}
    async for job, out in events:
        if isinstance(out, BaseException):
            yield sse(error_body(f"engine error: {out}", type="server_error"))
            return
        if out.error is not None:  # this request failed in the engine
            job.add(out)
            yield sse(error_body(f"engine error: {out.error}", type="server_error"))
            yield SSE_DONE
            return
        nj = by_job[id(job)]
        job.add(out)
        if out.new_token_ids or out.new_text or out.finished:
            body = nj.body()
            if multi:
                body["index"] = job.index
            yield sse(body)
    yield SSE_DONE


def _model_info(srv: Any) -> dict[str, Any]:
    engine = srv.engine
    config = getattr(engine.model, "config", None)
    archs = list(getattr(config, "architectures", None) or [])
    return {
        "model_path": engine.model_name,
        "tokenizer_path": str(getattr(engine.tokenizer, "name_or_path", "") or ""),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": str(getattr(config, "model_type", "") or ""),
        "architectures": archs,
        "served_model_name": srv.model_name,
    }


def _server_info(srv: Any) -> dict[str, Any]:
    engine = srv.engine
    cfg = dataclasses.asdict(engine.config)
    server = {k: v for k, v in dataclasses.asdict(srv.cfg).items() if k != "api_key"}
    stats = dataclasses.asdict(engine.stats())
    tree = engine.cache.tree
    cache = {
        "enabled": tree is not None,
        "tree_nodes": tree.num_nodes() if tree is not None else 0,
        "cached_tokens": tree.total_kv() if tree is not None else 0,
        "cached_states": tree.total_state() if tree is not None else 0,
        "kv_pool_size": engine.kv_pool.size,
        "state_pool_size": engine.state_pool.size,
    }
    hit = stats["cached_tokens"] / stats["prompt_tokens"] if stats["prompt_tokens"] else 0.0
    return {
        **cfg,
        **server,
        "served_model_name": srv.model_name,
        "model_path": engine.model_name,
        "tokenizer_path": str(getattr(engine.tokenizer, "name_or_path", "") or ""),
        "dp_size": 1,
        "tp_size": 1,
        "max_total_num_tokens": engine.kv_pool.size,
        "max_running_requests": engine.scheduler.max_running,
        "max_req_input_len": engine.context_length - 1,
        "context_length": engine.context_length,
        "kernel_backend": engine.kernel_backend,
        "internal_states": [{**stats, "cache_hit_rate": hit, "cache": cache}],
        "version": mambaradix.__version__,
    }


def _load(engine: Any) -> dict[str, int]:
    """Load of this (single-rank) server in the shape SGLang's ``/get_load`` entries have:
    ``num_tokens`` = KV tokens held by running requests + prompt tokens waiting."""
    stats = engine.stats()
    used = round(stats.token_usage * engine.kv_pool.size)
    waiting_tokens = 0
    for _ in range(3):  # the engine thread may change the queue while we read it
        try:
            waiting_tokens = sum(len(r.prompt_ids) for r in list(engine.scheduler.waiting))
            break
        except RuntimeError:
            continue
    return {
        "dp_rank": 0,
        "num_reqs": stats.num_running + stats.num_waiting,
        "num_waiting_reqs": stats.num_waiting,
        "num_tokens": used + waiting_tokens,
    }


def _flush(engine: Any) -> tuple[int, int | None]:
    """On the engine thread: (busy requests, tokens freed or None when refused)."""
    sched = engine.scheduler
    busy = len(sched.running) + len(sched.waiting)
    if not sched.is_idle():
        return max(busy, 1), None
    return 0, engine.cache.flush()
