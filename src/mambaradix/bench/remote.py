"""Benchmarking any server or router over HTTP: text prompts (as SGLang's ``bench_serving``
sends them) or token ids, to ``/v1/completions`` (``--backend openai``) or ``/generate``
(``--backend sglang``); the tokenizer that counts tokens; per-replica hit rates from each
replica's ``/metrics`` read before and after the run.

Text mode: the workload's token ids (sampled among whole-word tokens that survive a decode /
encode round trip, ``text_unsafe_ids``) are decoded to text with the benchmark's tokenizer and
the text is sent; the prompt's token ids (what the ideal hit rate is computed on) are the text
encoded again, and a turn's output ids are its output text encoded, so a multi-turn session
resends exactly what it saw. Routers that accept only strings (the SGLang Model Gateway) work.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import httpx

from mambaradix.bench.client import RequestResult, _Timing

logger = logging.getLogger(__name__)

BACKENDS = ["openai", "sglang"]
PROMPT_FORMATS = ["text", "token-ids"]


class RemoteBackend:
    """Streams one workload request at a time to ``base_url``; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        backend: str = "openai",
        prompt_format: str = "text",
        tokenizer: Any = None,
        model: str = "",
        api_key: str = "",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}, got {backend!r}")
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"--prompt-format must be one of {PROMPT_FORMATS}")
        if prompt_format == "text" and tokenizer is None:
            raise ValueError("text prompts need a tokenizer (--tokenizer)")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.backend = backend
        self.text = prompt_format == "text"
        self.tok = tokenizer
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(headers=headers, timeout=None, limits=limits)

    def _body(self, input_ids: list[int], output_len: int) -> tuple[str, dict[str, Any], str]:
        prompt: Any = self.tok.decode(input_ids) if self.text else list(input_ids)
        if self.backend == "sglang":
            body = {
                ("text" if self.text else "input_ids"): prompt,
                "sampling_params": {
                    "max_new_tokens": output_len,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                "stream": True,
            }
            return "/generate", body, prompt if self.text else ""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not self.text:
            body["return_token_ids"] = True  # a mambaradix / vLLM extension
        return "/v1/completions", body, prompt if self.text else ""

    async def generate(self, input_ids: list[int], output_len: int) -> RequestResult:
        path, body, text = self._body(input_ids, output_len)
        ids = self.tok.encode(text, add_special_tokens=False) if self.text else list(input_ids)
        res = RequestResult(prompt_ids=ids, prompt_len=len(ids))
        timing = _Timing()
        out_text: list[str] = []
        try:
            async with self.client.stream("POST", self.base_url + path, json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        res.success = not res.error
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        res.error = str(chunk["error"])
                        continue
                    if self.backend == "sglang":
                        self._sglang_chunk(chunk, res, timing, out_text)
                    else:
                        self._openai_chunk(chunk, res, timing, out_text)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
        res.latency, res.ttft, res.itls = timing.elapsed(), timing.ttft, timing.itls
        if self.text and not res.output_ids:
            res.output_ids = self.tok.encode("".join(out_text), add_special_tokens=False)
        res.output_len = res.output_len or len(res.output_ids)
        return res

    def _sglang_chunk(self, chunk: dict, res: RequestResult, timing: _Timing, text: list) -> None:
        meta = chunk.get("meta_info") or {}
        done = int(meta.get("completion_tokens") or 0)
        timing.tokens(done - res.output_len)
        res.output_len = max(res.output_len, done)
        res.cached_tokens = int(meta.get("cached_tokens") or 0)
        res.storage_tokens = int((meta.get("cached_tokens_details") or {}).get("storage") or 0)
        if chunk.get("output_ids") is not None:  # cumulative, like the text
            res.output_ids = list(chunk["output_ids"])
        text[:] = [chunk.get("text") or ""]
        if meta.get("prompt_tokens") and not self.text:
            res.prompt_len = int(meta["prompt_tokens"])

    def _openai_chunk(self, chunk: dict, res: RequestResult, timing: _Timing, text: list) -> None:
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids")
            n = len(ids) if ids is not None else int(bool(choice.get("text")))
            if ids:
                res.output_ids.extend(ids)
            text.append(choice.get("text") or "")
            timing.tokens(n)
        usage = chunk.get("usage")
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            res.cached_tokens = int(details.get("cached_tokens") or 0)
            res.output_len = int(usage.get("completion_tokens") or 0)

    async def aclose(self) -> None:
        await self.client.aclose()


def text_unsafe_ids(tok: Any, vocab: int, minimum: int = 16) -> set[int]:
    """Token ids a text workload should not sample: all but the whole words (a space and
    letters) that encode back to themselves, so that decoding a sampled prompt and encoding
    the text again gives the same ids (same lengths, same shared prefixes as in token-id
    mode). Empty (sample everything) when the vocabulary has fewer than ``minimum`` such."""
    safe = set()
    for i in range(vocab):
        s = tok.decode([i])
        if s.startswith(" ") and s[1:].isalpha() and tok.encode(s, add_special_tokens=False) == [i]:
            safe.add(i)
    if len(safe) < minimum:
        logger.warning("only %d round-tripping word tokens: text prompts sample any id", len(safe))
        return set()
    return set(range(vocab)) - safe


# --------------------------------------------------------------------------- server facts


async def model_info(base_url: str, api_key: str = "") -> dict[str, Any]:
    """``/get_model_info`` of a server or router (empty when it has none)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30) as c:
        try:
            r = await c.get(base_url.rstrip("/").removesuffix("/v1") + "/get_model_info")
        except httpx.HTTPError:
            return {}
        return r.json() if r.status_code == 200 else {}


def load_bench_tokenizer(path: str, info: dict[str, Any]) -> Any:
    """``--tokenizer`` or, when empty, the ``tokenizer_path`` the server reports if that
    folder exists here. Raises with the fix when neither works."""
    from mambaradix.models.loader import load_tokenizer  # transformers: import on use

    chosen = path or str(info.get("tokenizer_path") or "")
    if not path and not (chosen and os.path.isdir(chosen)):
        raise SystemExit(
            f"text prompts need a tokenizer: the server reports tokenizer_path={chosen!r}, "
            "which is not a folder here; pass --tokenizer <folder or tiny:<arch>> or "
            "--prompt-format token-ids"
        )
    return load_tokenizer(chosen)


_SAMPLE = re.compile(r"^(mambaradix:(?:prompt|cached)_tokens)(?:_total)?(?:\{[^}]*\})?\s+(\S+)$")


def read_counters(url: str, api_key: str = "") -> dict[str, float]:
    """Prompt and cached token counters from a replica's ``/metrics``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    out = {"prompt": 0.0, "cached": 0.0}
    for line in r.text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out["prompt" if m.group(1).endswith("prompt_tokens") else "cached"] += float(m[2])
    return out


def replica_hit_rates(
    urls: list[str], before: list[dict[str, float]], after: list[dict[str, float]]
) -> list[dict[str, Any]]:
    rows = []
    for url, b, a in zip(urls, before, after):
        prompt, cached = a["prompt"] - b["prompt"], a["cached"] - b["cached"]
        rows.append(
            {
                "url": url,
                "prompt_tokens": int(prompt),
                "cached_tokens": int(cached),
                "hit_rate": cached / prompt if prompt else 0.0,
            }
        )
    return rows
