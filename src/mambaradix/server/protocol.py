"""OpenAI-compatible request schemas, error bodies, response builders (the translation of a
request's fields to ``SamplingParams``: ``server.serving.openai_params``).

Requests are strict pydantic models (no type coercion, unknown keys refused; ``validation.py``
checks the body before them and turns their errors into 400s naming the field); responses are
plain dicts in the OpenAI wire format. Extensions implemented beyond OpenAI's schema (SGLang /
vLLM names): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``return_token_ids`` (adds ``token_ids`` to each
choice and ``prompt_token_ids``), ``stream_options.continuous_usage_stats``; structured output:
OpenAI's ``response_format``, SGLang's ``regex`` / ``json_schema`` / ``ebnf``, vLLM's
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
``structured_outputs``; chat:
``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``,
``separate_reasoning``, ``stream_reasoning``, ``thinking_token_budget`` (vLLM's; with
``--reasoning-parser``), messages' ``reasoning_content`` and ``name``;
completions: ``max_tokens: 0`` (with ``echo``: prompt logprobs only).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from mambaradix.core import MAX_TOP_LOGPROBS

MAX_N = 64


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (null means the default)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (SGLang / vLLM)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    return_token_ids: bool | None = False
    # structured output (server.structured): OpenAI's, and SGLang's extra body fields
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    # ... and vLLM's: the older guided_* fields and the newer structured_outputs object
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}]")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids. Raises APIError on an empty batch/prompt."""
        if self.best_of is not None and self.best_of != self.num_choices:
            raise APIError(
                "best_of other than n is not supported (no server-side ranking)", param="best_of"
            )
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
        return items


class TextPart(_Strict):
    type: Literal["text"]
    text: str


_NULL_ONLY_MESSAGE_FIELDS = ("refusal", "audio", "function_call")


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire shape)


class ToolCallMessage(_Strict):
    """An earlier assistant turn's call, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] | None = "function"
    function: FunctionCall
    index: int | None = None  # clients that rebuild calls from stream deltas keep it


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    refusal: Any = None
    audio: Any = None
    function_call: Any = None

    @field_validator(*_NULL_ONLY_MESSAGE_FIELDS)
    @classmethod
    def _null_only(cls, v: Any) -> Any:
        if v is not None and v != []:
            raise ValueError("is not supported by this server; only null is accepted")
        return None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                c.model_dump(exclude_none=True, exclude={"index"}) for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


# chat_template_kwargs may not override what the server passes itself
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "add_generation_prompt", "continue_final_message", "tokenize",
     "tools", "documents", "chat_template", "return_dict", "return_assistant_tokens_mask",
     "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs"}
)  # fmt: skip


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    separate_reasoning: bool | None = True
    stream_reasoning: bool | None = True
    thinking_token_budget: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_range(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be in [0, {MAX_TOP_LOGPROBS}]")
        return v

    def template_args(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Messages and keyword arguments for ``apply_chat_template``; APIError if bad."""
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        kwargs: dict[str, Any] = {}
        for key, value in (self.chat_template_kwargs or {}).items():
            if key in RESERVED_TEMPLATE_KWARGS:
                raise APIError(
                    f"chat_template_kwargs may not set '{key}'",
                    param=f"chat_template_kwargs.{key}",
                )
            kwargs[key] = value
        cont = bool(self.continue_final_message)
        gen = self.add_generation_prompt is not False
        if cont:
            if self.messages[-1].role != "assistant":
                raise APIError(
                    "continue_final_message needs the last message to be the assistant's",
                    param="continue_final_message",
                )
            if self.add_generation_prompt is True and "add_generation_prompt" in (
                self.model_fields_set
            ):
                raise APIError(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            gen = False
        kwargs["add_generation_prompt"] = gen
        kwargs["continue_final_message"] = cont
        return [m.template_dict() for m in self.messages], kwargs

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


def response_envelope(kind: str, rid: str, model: str, choices: list[dict]) -> dict[str, Any]:
    """``kind`` is 'text_completion', 'chat.completion' or 'chat.completion.chunk'."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
