"""OpenAI-compatible HTTP server over an ``Engine`` (FastAPI; run it with uvicorn).

``create_app(engine, server_config)`` builds the app; ``ServerThread`` runs it in-process on a
free port (tests, the in-process benchmark over HTTP). Routes: ``/v1/completions`` (text or
token-id prompts, batches), ``/v1/chat/completions`` (the checkpoint's chat template), both with
SSE streaming; ``/v1/models``, ``/health``, ``/health_generate`` (``server.health``), ``/metrics``;
SGLang's native routes (``/generate``, ``/get_server_info``, ...) come from ``native.py``, and
with ``--enable-debug-endpoints`` the debug ones (``/debug/tree``) from ``debug.py``.

Contract at the seam: every client error is a 4xx with an OpenAI error body naming the field
(``validation.py``) and the server keeps serving; an unexpected error is a complete 500 response
(or, mid-stream, a properly ended stream), so the keep-alive connection stays usable; a request
whose client went away (mid-stream or while waiting) is aborted in the engine, which frees its
slots, and counted as aborted. While draining for shutdown, new requests get 503. Tokenization
and chat templating of long inputs run in a worker thread, off the event loop, so one 10 MB body
does not stall every other client and /health.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from mambaradix.config import ServerConfig
from mambaradix.core import ReasoningGate
from mambaradix.server.debug import debug_router
from mambaradix.server.guard import ServerErrorGuard
from mambaradix.server.health import add_health_routes
from mambaradix.server.jobs import Choices, Job
from mambaradix.server.logprobs import TokenTable
from mambaradix.server.metrics import ServerMetrics
from mambaradix.server.native import native_router
from mambaradix.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    response_envelope,
    usage_dict,
)
from mambaradix.server.reasoning import END, START, starts_in_reasoning
from mambaradix.server.serving import (
    SSE_DONE,
    Events,
    collect,
    openai_params,
    read_json,
    sse,
    sse_response,
)
from mambaradix.server.structured import grammar_of
from mambaradix.server.tools import ToolCalling, resolve_tools, template_messages
from mambaradix.server.validation import validate_body

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}
OFF_LOOP_CHARS = 4096  # text longer than this is tokenized / templated in a worker thread


class _Server:
    """State shared by the routes of one app."""

    def __init__(self, engine: Any, cfg: ServerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.model_name = cfg.served_model_name or engine.model_name
        self.accepted_names = {self.model_name, engine.model_name}
        self.metrics = ServerMetrics(engine, self.model_name, cfg.metrics_prefix)
        self.vocab_size = len(engine.tokenizer)
        self.table = TokenTable(engine.tokenizer)
        self.max_body = int(cfg.max_body_mb * (1 << 20))
        template = cfg.chat_template
        if template and os.path.isfile(template):
            with open(template, encoding="utf-8") as f:
                template = f.read()
        self.chat_template: str | None = template or None
        self.draining = False  # shutting down: new requests get 503
        self.active = 0  # generation requests being served (graceful shutdown waits for them)

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(
                "the server is shutting down and admits no new requests", 503, "server_error"
            )

    def check_model(self, name: str | None) -> None:
        if name and name not in self.accepted_names:
            raise APIError(
                f"model '{name}' is not served here; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                f"prompt: token id {bad[0]} is out of range [0, {self.vocab_size})", param="prompt"
            )

    def max_tokens_for(self, prompt_len: int, requested: int | None, least: int = 1) -> int:
        """The engine's max_new_tokens (at least 1; a completion's ``max_tokens: 0``, with
        ``least`` 0, generates one token that is not reported)."""
        ctx = self.engine.context_length
        if requested is None:
            requested = ctx - prompt_len
        if requested < least:
            raise APIError(f"max_tokens must be >= {least}, got {requested}", param="max_tokens")
        requested = max(requested, 1)
        if prompt_len + requested > ctx:
            raise APIError(
                f"this model's maximum context length is {ctx} tokens; the request has "
                f"{prompt_len} prompt tokens and asks for {requested} completion tokens; "
                "shorten the prompt or lower max_tokens",
                param="max_tokens" if prompt_len < ctx else "prompt",
                code="context_length_exceeded",
            )
        return requested

    def submit(self, jobs: list[Job], keep_rids: bool = False) -> None:
        """Submit all jobs or none (a job the engine refuses aborts the ones before it); with
        ``keep_rids``, one by one under the jobs' own rids (client-chosen ones)."""
        many = getattr(self.engine, "submit_many", None)
        if len(jobs) > 1 and many is not None and not keep_rids:
            # one inbox item: the engine sees the batch arrive together (in-batch sharing)
            try:
                handles = many([j.input_ids for j in jobs], [j.params for j in jobs])
            except ValueError as e:
                raise APIError(str(e)) from None
            for job, handle in zip(jobs, handles):
                job.handle, job.rid, job.timer = handle, handle.rid, self.metrics.timer()
            return
        for i, job in enumerate(jobs):
            try:
                job.handle = self.engine.submit(job.input_ids, job.params, rid=job.rid)
            except ValueError as e:
                for prev in jobs[:i]:
                    self.engine.abort(prev.rid)
                raise APIError(str(e)) from None
            job.timer = self.metrics.timer()


def create_app(engine: Any, server_config: ServerConfig | None = None) -> FastAPI:
    srv = _Server(engine, server_config or ServerConfig())
    app = FastAPI(title="mambaradix", docs_url=None, redoc_url=None)
    app.state.server = srv

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        srv.metrics.count_error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        srv.metrics.count_error(400)
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot parse')}"
            return JSONResponse(error_body(msg, code="json_invalid"), status_code=400)
        # drop pydantic's union-branch names ('str', 'list[int]') from the location
        loc = [
            str(x)
            for x in first.get("loc", ())
            if x != "body" and not (isinstance(x, str) and (x in _TYPE_NAMES or "[" in x))
        ]
        param = ".".join(loc) or None
        msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more errors)"
        return JSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        srv.metrics.count_error(exc.status_code)
        return JSONResponse(
            error_body(str(exc.detail), code=exc.status_code), status_code=exc.status_code
        )

    # Not an exception_handler(Exception): Starlette runs that one in its outermost middleware
    # and re-raises after answering, and uvicorn then drops the keep-alive connection.
    app.add_middleware(ServerErrorGuard, on_error=srv.metrics.count_error)

    if srv.cfg.api_key:
        expected = f"Bearer {srv.cfg.api_key}"

        @app.middleware("http")
        async def _auth(request: Request, call_next: Any) -> Response:
            if request.url.path.startswith("/v1") and (
                request.headers.get("authorization") != expected
            ):
                return JSONResponse(
                    error_body("invalid or missing API key", code="invalid_api_key"),
                    status_code=401,
                )
            return await call_next(request)

    add_health_routes(app, srv)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(srv.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": srv.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "mambaradix",
            "root": engine.model_name,
            "max_model_len": engine.context_length,
            "vocab_size": srv.vocab_size,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        srv.check_admitting()
        req = await _parse(srv, request, CompletionRequest, "completion")
        srv.check_model(req.model)
        tok = engine.tokenizer
        want_lps = req.logprobs is not None
        ch = Choices(False, req, tok, srv.table, logprobs=want_lps, discard=req.max_tokens == 0)
        jobs: list[Job] = []
        n = req.num_choices
        grammar = grammar_of(req)
        for p_idx, prompt in enumerate(req.prompts()):
            if isinstance(prompt, str):
                ids = await _off_loop(len(prompt), tok.encode, prompt)
            else:
                ids = list(prompt)
            srv.check_ids(ids)
            max_new = srv.max_tokens_for(len(ids), req.max_tokens, least=0)
            params = openai_params(req, max_new, srv.vocab_size)
            params.grammar = grammar
            params.return_logprob = want_lps
            params.top_logprobs = req.logprobs or 0
            echo_text = None
            if req.echo:
                echo_text = prompt if isinstance(prompt, str) else tok.decode(ids)
                if want_lps:
                    params.prompt_logprob_start = 1
                    params.prompt_top_logprobs = req.logprobs or 0
            for j in range(n):
                jobs.append(Job.make(p_idx * n + j, ids, params, j, ch, p_idx, echo_text))
        return await _serve(srv, jobs, req, request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Any:
        srv.check_admitting()
        req = await _parse(srv, request, ChatCompletionRequest, "chat")
        srv.check_model(req.model)
        tok = engine.tokenizer
        size = sum(len(str(getattr(m, "content", None) or "")) for m in req.messages)
        template = srv.chat_template or getattr(tok, "chat_template", None)
        calling = resolve_tools(req, srv.cfg.tool_call_parser, template)
        text, kwargs = await _off_loop(size, _render_chat, srv, tok, req, calling)
        ids = await _off_loop(len(text), lambda: tok.encode(text, add_special_tokens=False))
        params = openai_params(
            req, srv.max_tokens_for(len(ids), req.requested_max_tokens()), srv.vocab_size
        )
        # a forced tool call (resolve_tools refuses one beside a constraint field), else the fields'
        params.grammar = calling.grammar if calling and calling.grammar else grammar_of(req)
        params.return_logprob = bool(req.logprobs)
        params.top_logprobs = req.top_logprobs or 0
        ch = Choices(True, req, tok, srv.table, logprobs=bool(req.logprobs), tools=calling)
        parser = srv.cfg.reasoning_parser
        budget = req.thinking_token_budget
        if budget is not None and (not parser or budget < 0):
            raise APIError(
                "thinking_token_budget must be >= 0" if parser else
                "thinking_token_budget needs a server started with --reasoning-parser",
                param="thinking_token_budget",
            )  # fmt: skip
        if parser:
            thinking = starts_in_reasoning(parser, text, kwargs)
            # the grammar binds the answer, not the reasoning; the budget caps the reasoning
            if params.grammar is not None or budget is not None:
                params.reasoning_gate = ReasoningGate(START, END, thinking)
                params.thinking_budget = -1 if budget is None else budget
            if req.separate_reasoning is not False:
                ch.in_reasoning = thinking
                ch.stream_reasoning = req.stream_reasoning is not False
        jobs = [Job.make(j, ids, params, j, ch, prompt_key=0) for j in range(req.num_choices)]
        return await _serve(srv, jobs, req, request, chat=True)

    app.include_router(native_router(srv))  # SGLang's /generate, /get_server_info, ...
    if srv.cfg.enable_debug_endpoints:
        app.include_router(debug_router(srv))  # /debug/tree
    return app


def _render_chat(
    srv: _Server, tok: Any, req: ChatCompletionRequest, calling: ToolCalling | None = None
) -> tuple[str, dict]:
    """The prompt text from the chat template (with the request's tools); a 400 when there is no
    template or the template refuses the conversation (its raise_exception, a missing
    variable)."""
    messages, kwargs = req.template_args()
    messages = template_messages(req, messages)
    if calling is not None:
        kwargs["tools"] = calling.tools
    template = srv.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise APIError(
            "this model has no chat template; send the prompt to /v1/completions, or start the "
            "server with --chat-template",
            param="messages",
            code="no_chat_template",
        )
    try:
        text = tok.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)
    except Exception as e:
        if isinstance(e, (ValueError, TypeError, LookupError)) or (
            type(e).__module__.startswith("jinja2")
        ):
            raise APIError(
                f"the chat template refused the request: {e}", param="messages"
            ) from None
        raise
    return text, kwargs


async def _off_loop(size: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)``: inline for small inputs (a thread hop costs more than the work), in a
    worker thread for large ones (a 10 MB body took seconds on the event loop)."""
    if size <= OFF_LOOP_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _parse(srv: _Server, request: Request, model: type[M], kind: str) -> M:
    """The body as JSON whatever its content type (curl -d sends form encoding), validated."""
    return validate_body(await read_json(srv, request), model, kind)  # type: ignore[return-value]


async def _serve(srv: _Server, jobs: list[Job], req: Any, request: Request, chat: bool) -> Any:
    srv.check_admitting()
    srv.submit(jobs)
    rid = new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        return sse_response(srv, jobs, lambda events: _frames(srv, jobs, req, rid, chat, events))
    await collect(srv, request, jobs)
    kind = "chat.completion" if chat else "text_completion"
    body = response_envelope(kind, rid, srv.model_name, [j.final_choice() for j in jobs])
    body["usage"] = _usage(jobs)
    return body


def _usage(jobs: list[Job]) -> dict[str, Any]:
    # n > 1 copies of one prompt count the prompt once, like OpenAI
    seen: set[int] = set()
    prompt = cached = 0
    for job in jobs:
        if job.prompt_key not in seen:
            seen.add(job.prompt_key)
            prompt += job.prompt_tokens
            cached += job.cached_tokens
    return usage_dict(prompt, sum(j.completion_tokens for j in jobs), cached)


async def _frames(
    srv: _Server, jobs: list[Job], req: Any, rid: str, chat: bool, events: Events
) -> AsyncIterator[str]:
    """OpenAI's SSE events: one chunk per engine event per choice, an optional usage chunk,
    [DONE]; a request failed in the engine is an error event, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        for job in jobs:
            first = {"index": job.index, "delta": {"role": "assistant", "content": ""}}
            first["logprobs"], first["finish_reason"] = None, None
            yield sse(response_envelope(kind, rid, srv.model_name, [first]))
    async for job, out in events:
        if isinstance(out, BaseException) or out.error is not None:
            if not isinstance(out, BaseException):
                job.add(out)  # the request failed in the engine: an error event, [DONE]
                out = APIError(out.error, 500, "server_error")
            err = out if isinstance(out, APIError) else APIError(str(out), 500, "server_error")
            yield sse(err.body())
            yield SSE_DONE
            return
        job.add(out)
        choice = job.chunk_choice(out)
        if choice is not None:
            body = response_envelope(kind, rid, srv.model_name, [choice])
            if req.continuous_usage:
                body["usage"] = usage_dict(
                    job.prompt_tokens, job.completion_tokens, job.cached_tokens
                )
            if req.return_token_ids and out.finished:
                body["prompt_token_ids"] = job.input_ids
            yield sse(body)
    if req.include_usage:
        body = response_envelope(kind, rid, srv.model_name, [])
        body["usage"] = _usage(jobs)
        yield sse(body)
    yield SSE_DONE
