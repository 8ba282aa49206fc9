"""OpenAI-compatible request schemas, their translation to ``SamplingParams``, response builders.

Requests are pydantic models (wrong types become HTTP 400 in ``app.py``); responses are plain
dicts in the OpenAI wire format. Extensions accepted in request bodies (SGLang / vLLM names):
``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ``seed``, ``skip_special_tokens``, and
``return_token_ids`` (adds ``token_ids`` to each choice and ``prompt_token_ids``, which the
benchmark's multi-turn workload needs to resend a conversation token for token).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mambaradix.core import SamplingParams


class APIError(Exception):
    """An error a client caused (or a server fault), rendered as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # extensions (SGLang / vLLM)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False

    def sampling_params(self, max_new_tokens: int, return_logprob: bool) -> SamplingParams:
        """Translate to engine params; raises APIError naming the offending field."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise APIError(f"{name} is not supported (only 0)", param=name)
        if self.n < 1 or self.n > 16:
            raise APIError(f"n must be in [1, 16], got {self.n}", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise APIError("stop strings must not be empty", param="stop")
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            return_logprob=return_logprob,
            skip_special_tokens=self.skip_special_tokens,
        )
        if params.temperature > 2.0:
            raise APIError(
                f"temperature must be in [0, 2], got {params.temperature}", param="temperature"
            )
        try:
            params.validate()
        except ValueError as e:
            raise APIError(str(e), param=_param_of(str(e))) from None
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_PARAM_NAMES = {"max_new_tokens": "max_tokens"}


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return _PARAM_NAMES.get(word, word) if word.isidentifier() else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids. Raises APIError on an empty batch/prompt."""
        p = self.prompt
        if isinstance(p, str):
            items: list[str | list[int]] = [p]
        elif not p:
            raise APIError("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]  # type: ignore[list-item]
        else:
            items = list(p)  # type: ignore[arg-type]
        if any(len(x) == 0 for x in items):
            raise APIError("prompt must not be empty", param="prompt")
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        return items


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def chat_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(token_strs: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "tokens": token_strs,
        "token_logprobs": logprobs,
        "top_logprobs": [None] * len(logprobs),
        "text_offset": [],
    }


def chat_logprobs(token_strs: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(token_strs, logprobs)
        ]
    }


def response_envelope(kind: str, rid: str, model: str, choices: list[dict]) -> dict[str, Any]:
    """``kind`` is 'text_completion', 'chat.completion' or 'chat.completion.chunk'."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
