"""Strict request validation: the body's bytes, its JSON, and which fields it may carry.

Order: size (413 over ``--max-body-mb``), UTF-8 and JSON syntax (no NaN / Infinity), one walk
over the parsed value (nesting at most ``MAX_DEPTH``, no lone surrogates in any string or key),
then the field table: a field this server implements goes to the pydantic model (strict types,
unknown nested keys refused); a field of the OpenAI, SGLang or vLLM request schemas that it does
not implement is accepted only at its default (or null) and dropped, any other value is a 400
naming it; any other field is a 400 naming it. Every refusal is an ``APIError`` (4xx) whose
``param`` names the field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ValidationError

from mambaradix.server.protocol import APIError

MAX_DEPTH = 64

# Accepted values besides null of request fields that peers define and this server does not
# implement (a value equal to its default has no effect to implement). Fields of items a later
# change implements (tools, structured output) leave this table when they do.
_PEER_FIELDS_COMMON: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "metadata": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "prompt_cache_key": (),
    "safety_identifier": (),
    # SGLang
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "return_cached_tokens_details": (False,),
    "lora_path": (),
    "session_id": (),
    "session_params": (),
    "custom_params": (),
    "custom_logit_processor": (),
    "images_config": (),
    "bootstrap_host": (),
    "bootstrap_port": (),
    "bootstrap_room": (),
    "routed_dp_rank": (),
    "disagg_prefill_dp_rank": (),
    "data_parallel_rank": (),
    "rid": (),
    "extra_key": (),
    "cache_salt": (),
    "ngram_corpus_id": (),
    "priority": (0,),
    "custom_labels": (),
    "stop_regex": (),
    "no_stop_trim": (False,),
    "logprob_start_len": (-1,),
    # vLLM
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "include_stop_str_in_output": (False,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    "request_id": (),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "mm_processor_kwargs": (),
    "media_io_kwargs": (),
}
_PEER_FIELDS_COMPLETION: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "add_special_tokens": (True,),
    "prompt_embeds": (),
}
_PEER_FIELDS_CHAT: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "functions": (),
    "function_call": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    # SGLang
    "task": (),
    "max_dynamic_patch": (),
    "min_dynamic_patch": (),
    "use_audio_in_video": (False,),
    "input_ids": (),
    "return_prompt_token_ids": (False,),
    "return_meta_info": (False,),
    "reasoning": (),
    # vLLM
    "echo": (False,),
    "best_of": (1,),
    "add_special_tokens": (False,),
    "documents": (),
    "chat_template": (),
    "include_reasoning": (True,),
}
PEER_FIELDS = {
    "completion": {**_PEER_FIELDS_COMMON, **_PEER_FIELDS_COMPLETION},
    "chat": {**_PEER_FIELDS_COMMON, **_PEER_FIELDS_CHAT},
}


def _same(value: Any, accepted: Any) -> bool:
    """JSON equality where true is not 1 and 1 equals 1.0."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return type(value) is type(accepted) and value == accepted
    if isinstance(value, (int, float)) and isinstance(accepted, (int, float)):
        return value == accepted
    return type(value) is type(accepted) and value == accepted


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    """The body as JSON, walked once; APIError on bad encoding, syntax, depth or strings."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise APIError(f"the body is not valid UTF-8: {e}", code="json_invalid") from None
    except RecursionError:
        raise APIError(
            f"the body's JSON is nested too deeply (at most {MAX_DEPTH} levels)",
            code="json_invalid",
        ) from None
    except ValueError as e:  # JSONDecodeError and NaN / Infinity
        raise APIError(f"malformed JSON body: {e}", code="json_invalid") from None
    check_values(data)
    return data


def check_values(data: Any) -> None:
    """Depth at most MAX_DEPTH; every string and key encodable as UTF-8 (no lone surrogates,
    which JSON's \\ud800 escapes can make and no tokenizer takes)."""
    stack: list[tuple[Any, int, tuple]] = [(data, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                _check_text(value, path)
        elif isinstance(value, list):
            if depth >= MAX_DEPTH:
                _too_deep(path)
            if value and type(value[0]) is int and all(type(v) is int for v in value):
                continue  # token ids: nothing below
            stack.extend((v, depth + 1, (*path, i)) for i, v in enumerate(value))
        elif isinstance(value, dict):
            if depth >= MAX_DEPTH:
                _too_deep(path)
            for k, v in value.items():
                if not k.isascii():
                    _check_text(k, path)
                stack.append((v, depth + 1, (*path, k)))


def _path(path: tuple) -> str | None:
    return ".".join(str(p) for p in path) or None


def _too_deep(path: tuple) -> None:
    field = str(path[0]) if path else None
    raise APIError(
        f"{field or 'body'}: JSON nested too deeply (at most {MAX_DEPTH} levels)", param=field
    )


def _check_text(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = _path(path) or "body"
        raise APIError(
            f"{where}: the string holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
            "valid Unicode text",
            param=_path(path),
        ) from None


def check_fields(data: dict[str, Any], model: type[BaseModel], kind: str) -> dict[str, Any]:
    """The body without the peers' fields left at their defaults; APIError for any field
    that is unknown or set to a value this server does not implement."""
    known = model.model_fields
    peer = PEER_FIELDS[kind]
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in known:
            out[key] = value
            continue
        accepted = peer.get(key)
        if accepted is None:
            raise APIError(f"unknown field '{key}'", param=key, code="unknown_field")
        if value is not None and not any(_same(value, a) for a in accepted):
            defaults = ", ".join(["null", *(json.dumps(a) for a in accepted)])
            raise APIError(
                f"'{key}' is not supported by this server; only its default ({defaults}) is "
                "accepted",
                param=key,
                code="unsupported_field",
            )
    return out


def validate_body(data: Any, model: type[BaseModel], kind: str) -> BaseModel:
    """Field table, then the strict pydantic model; APIError naming the field."""
    if not isinstance(data, dict):
        raise APIError(f"the body must be a JSON object, got {type(data).__name__}")
    body = check_fields(data, model, kind)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise pydantic_error(e.errors()) from None


_TYPE_WORDS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def _loc(error: dict[str, Any]) -> str | None:
    """The dotted field path of a pydantic error, without its union-branch names."""
    loc = [
        str(x)
        for x in error.get("loc", ())
        if x != "body" and not (isinstance(x, str) and (x in _TYPE_WORDS or "[" in x))
    ]
    return ".".join(loc) or None


def pydantic_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 for pydantic's errors: the first, with its field's dotted path."""
    first = errors[0] if errors else {}
    param = _loc(first)
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unknown field '{param}'"
    elif kind == "missing":
        msg = f"'{param}' is required"
    else:
        msg = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        got = first.get("input")
        if isinstance(got, (int, float, str, bool)) and not (
            isinstance(got, float) and math.isnan(got)
        ):
            msg += f" (got {json.dumps(got)[:80]})"
    n_more = len({_loc(e) for e in errors}) - 1
    if n_more > 0 and kind not in ("extra_forbidden", "missing"):
        msg += f" (and {n_more} more error{'s' * (n_more > 1)})"
    return APIError(msg, param=param)
