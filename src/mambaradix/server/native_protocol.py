"""SGLang's native request schemas (``/generate``, ``/tokenize``, ``/detokenize``) and the
SGLang-shaped response pieces (``meta_info``, ``finish_reason``).

Field names and defaults are SGLang's (``GenerateReqInput`` and its ``sampling_params``).
Fields we implement are translated to ``SamplingParams`` (``server.serving.native_params``);
fields SGLang clients and the gateway send at their defaults (``lora_path: null``,
``logprob_start_len: -1``, ``return_hidden_states: false``...) are accepted at exactly those
defaults, and any other value is an ``APIError`` (HTTP 400) naming the field. A field SGLang
does not know is a 400 too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from mambaradix.server.protocol import APIError

# Request fields accepted only at their SGLang default (value we do not implement otherwise).
_GENERATE_DEFAULTS: dict[str, Any] = {
    "token_ids_logprob": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "return_entropy": False,
    "return_bytes": False,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "data_parallel_rank": None,
    "background": False,
    "conversation_id": None,
    "priority": None,
    "extra_key": None,
    "require_reasoning": False,
}
# Request fields that only affect logging / tracing on SGLang's side: any value is fine.
_GENERATE_IGNORABLE = {"log_metrics", "no_logs", "custom_labels", "stream_options"}

_SAMPLING_DEFAULTS: dict[str, Any] = {
    "min_new_tokens": 0,
    "stop_regex": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "structural_tag": None,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
}
_SAMPLING_FIELDS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "n", "sampling_seed", "regex", "json_schema", "ebnf",
}  # fmt: skip

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


def _check_defaults(data: dict[str, Any], defaults: dict[str, Any], prefix: str) -> None:
    for name, default in defaults.items():
        if name in data and data[name] != default and data[name] != (default or None):
            raise APIError(
                f"{prefix}{name}={data[name]!r} is not supported here (only {default!r})",
                param=prefix + name,
            )


class NativeSampling(BaseModel):
    """One ``sampling_params`` object (SGLang names)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None

    @classmethod
    def parse(cls, raw: Any, where: str) -> NativeSampling:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise APIError(f"{where} must be an object", param=where)
        unknown = sorted(set(raw) - _SAMPLING_FIELDS - set(_SAMPLING_DEFAULTS))
        if unknown:
            raise APIError(f"{where}.{unknown[0]} is not a sampling parameter", param=where)
        _check_defaults(raw, _SAMPLING_DEFAULTS, where + ".")
        known = {k: v for k, v in raw.items() if k in _SAMPLING_FIELDS}
        try:
            return cls.model_validate(known)
        except Exception as e:  # pydantic's message names the field
            raise APIError(f"{where}: {e}", param=where) from None


class GenerateRequest(BaseModel):
    """``POST /generate``: one prompt or a batch, as text or token ids."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    model: str | None = None  # the gateway may add it; checked against the served name

    def check_fields(self) -> None:
        extra = dict(self.model_extra or {})
        unknown = sorted(set(extra) - set(_GENERATE_DEFAULTS) - _GENERATE_IGNORABLE)
        if unknown:
            raise APIError(f"{unknown[0]} is not a /generate field", param=unknown[0])
        _check_defaults(extra, _GENERATE_DEFAULTS, "")

    def rid_list(self) -> list[str | None]:
        return list(self.rid) if isinstance(self.rid, list) else [self.rid]

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """The prompts and whether the request was a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError("send exactly one of text or input_ids", param="text")
        if self.text is not None:
            batch = isinstance(self.text, list)
            items: list[Any] = list(self.text) if batch else [self.text]
        else:
            ids = self.input_ids or []
            batch = bool(ids) and isinstance(ids[0], list)
            items = [list(x) for x in ids] if batch else [list(ids)]
        if not items or any(len(x) == 0 for x in items):
            raise APIError("the prompt must not be empty", param="text")
        return items, batch

    def per_prompt(self, n_prompts: int) -> list[PromptOptions]:
        """Sampling params, rid and logprob options of each prompt (lists must match)."""

        def spread(value: Any, name: str) -> list[Any]:
            if isinstance(value, list):
                if len(value) != n_prompts:
                    raise APIError(
                        f"{name} has {len(value)} entries for {n_prompts} prompts", param=name
                    )
                return value
            return [value] * n_prompts

        sps = self.sampling_params
        if isinstance(sps, list):
            parsed = [NativeSampling.parse(p, f"sampling_params[{i}]") for i, p in enumerate(sps)]
        else:
            parsed = [NativeSampling.parse(sps, "sampling_params")]
        samplings = spread(parsed if isinstance(sps, list) else parsed[0], "sampling_params")
        rids = spread(self.rid, "rid")
        if self.rid is not None and n_prompts > 1 and not isinstance(self.rid, list):
            raise APIError("a batch needs one rid per prompt (a list)", param="rid")
        lps = spread(self.return_logprob, "return_logprob")
        starts = spread(self.logprob_start_len, "logprob_start_len")
        tops = spread(self.top_logprobs_num, "top_logprobs_num")
        return [PromptOptions(*o) for o in zip(samplings, rids, lps, starts, tops)]


class PromptOptions(NamedTuple):
    """What a /generate request asks for one of its prompts."""

    sampling: NativeSampling
    rid: str | None
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] | list[list[int]] = Field(min_length=0)
    skip_special_tokens: bool = True


# --------------------------------------------------------------------------- responses


def finish_reason(reason: str | None, matched: str | int | None, length: int) -> Any:
    """SGLang's ``meta_info.finish_reason``: ``{"type": "stop", "matched": ...}``,
    ``{"type": "length", "length": n}``, ``{"type": "abort", "message": ...}`` or None."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": length}
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": "request aborted"}


Decode = Callable[[int], str] | None


def _entry(lp: float | None, tok: int, decode: Decode) -> list[Any]:
    return [lp, tok, decode(tok) if decode is not None else None]


def _tops(top: Any, decode: Decode) -> list[list[Any]] | None:
    if top is None:
        return None
    ids, values = top
    return [_entry(v, i, decode) for i, v in zip(ids, values)]


def logprob_meta(
    input_ids: list[int],
    start: int,
    top_n: int,
    output: tuple[list[int], list[float], list[Any]],
    prompt: tuple[list[float] | None, list[Any] | None],
    decode: Decode,
) -> dict[str, Any]:
    """SGLang's logprob fields of ``meta_info``: ``input_token_logprobs`` (``[logprob,
    token id, text or None]`` for prompt tokens ``start`` (-1: the last) .. L-1, the first
    without a logprob, as SGLang reports it), ``output_token_logprobs`` (one per output token)
    and, with ``top_n``, ``input_top_logprobs`` / ``output_top_logprobs`` (per token a list of
    entries, best first; None for the first prompt token). ``output`` is (ids, logprobs, top
    (ids, values) per token), ``prompt`` the engine's prompt logprobs and tops from ``start +
    1`` (None before they arrive)."""
    s = len(input_ids) - 1 if start == -1 else start
    ids, lps, tops = output
    prompt_lps, prompt_tops = prompt
    later = input_ids[s + 1 :]
    meta: dict[str, Any] = {
        "input_token_logprobs": [_entry(None, input_ids[s], decode)]
        + [_entry(lp, t, decode) for lp, t in zip(prompt_lps or [], later)],
        "output_token_logprobs": [_entry(lp, t, decode) for lp, t in zip(lps, ids)],
    }
    if top_n:
        meta["input_top_logprobs"] = [None] + [_tops(t, decode) for t in (prompt_tops or [])]
        meta["output_top_logprobs"] = [_tops(t, decode) for t in tops[: len(lps)]]
    return meta
