"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, per-request
logits processing (``engine.logits_process``), logprobs and top-k logprobs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mambaradix.core import SamplingParams

TopLogprobs = tuple[list[int], list[float]]  # token ids, their logprobs (best first)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    states: list | None = None,
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """Pick one token per row of ``logits`` [B, V]; return the tokens, their logprobs under the
    model's (unprocessed) distribution, and per row its ``top_logprobs`` best alternatives
    (None where the request asks for none). ``states`` holds each row's ``RequestLogits`` (or
    None); each state processes its row before sampling and accepts the token sampled.
    ``constrain(logits)`` masks rows in place (grammars) after the logprobs are taken: they
    stay those of the model's own distribution."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if constrain is not None:
        constrain(logits)
    greedy = logits.argmax(dim=-1)
    tokens = greedy.tolist()
    for i, p in enumerate(params):
        state = states[i] if states else None
        is_greedy = p.temperature == 0.0 or p.top_k == 1
        if state is None:
            if not is_greedy:
                tokens[i] = _sample_row(logits[i], p, generators[i])
            continue
        row = state(logits[i])
        tokens[i] = int(row.argmax().item()) if is_greedy else _sample_row(row, p, generators[i])
        state.accept(tokens[i])
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]
    return tokens, chosen.tolist(), top_logprobs(logprobs, [p.top_logprobs for p in params])


def top_logprobs(logprobs: torch.Tensor, ks: list[int]) -> list[TopLogprobs | None]:
    """Per row of ``logprobs`` [N, V], its ``ks[i]`` best (ids, logprobs), or None for k 0."""
    k = max(ks, default=0)
    if k <= 0:
        return [None] * len(ks)
    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [(ids[i][:n], values[i][:n]) if n > 0 else None for i, n in enumerate(ks)]


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = cum - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
