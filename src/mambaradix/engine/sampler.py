"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, per-request
logits processing (``engine.logits_process``), logprobs and top-k logprobs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mambaradix.core import SamplingParams
from mambaradix.kernels.sampling import Normalizer, argmax_logsumexp, logprobs_of
from mambaradix.layout import to_device

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
    # one pass: the greedy tokens and each row's softmax normalizer, from which the logprobs
    # of the chosen and top tokens follow (no [B, V] log_softmax); a row's values never
    # depend on the other rows
    greedy, norm = argmax_logsumexp(logits)
    if constrain is None and not states and all(_greedy(p) for p in params):
        # every row greedy: the tokens and their logprobs in one read of the device
        ids, lps = _greedy_pair(logits, greedy, norm).tolist()
        tops = top_logprobs(logits, [p.top_logprobs for p in params], norm)
        return [int(t) for t in ids], lps, tops
    raw = logits  # the model's distribution; masks and processing write to a copy
    if constrain is not None or states:
        logits = logits.clone()
    if constrain is not None:
        constrain(logits)
        greedy, _ = argmax_logsumexp(logits, want_norm=False)
    tokens = greedy.tolist()
    # processed rows in place of their raw ones in the copy:
    # then the processed greedy rows' tokens come in one read, and every sampled row moves to
    # where its generator draws in one copy, whatever the batch size
    owned = [i for i in range(len(params)) if states and states[i] is not None]
    for i in owned:
        logits[i] = states[i](logits[i])
    again = [i for i in owned if _greedy(params[i])]
    if again:
        index = to_device(torch.tensor(again, dtype=torch.long), logits.device)
        for i, t in zip(again, logits.index_select(0, index).argmax(-1).tolist()):
            tokens[i] = t
    moved = _rows_where_drawn(logits, params, generators)
    for i, p in enumerate(params):
        if not _greedy(p):
            tokens[i] = _sample_row(moved.get(i, logits[i]), p, generators[i])
    for i in owned:
        states[i].accept(tokens[i])
    picked = to_device(torch.tensor(tokens, dtype=torch.long), raw.device)[:, None]
    chosen = logprobs_of(raw.gather(1, picked), norm)
    return tokens, chosen[:, 0].tolist(), top_logprobs(raw, [p.top_logprobs for p in params], norm)


def _rows_where_drawn(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> dict[int, torch.Tensor]:
    """The sampled rows whose generators draw on another device than the logits (a request's
    seeded CPU generator, the logits on a GPU), moved there in one copy per device: one read of
    the GPU for the batch instead of one per row. Each row is what ``on_generator_device``
    would have moved alone."""
    want: dict[torch.device, list[int]] = {}
    for i, (p, gen) in enumerate(zip(params, generators)):
        if _greedy(p) or gen is None:
            continue
        if gen.device != logits.device:
            want.setdefault(gen.device, []).append(i)
    out: dict[int, torch.Tensor] = {}
    for device, rows in want.items():
        index = to_device(torch.tensor(rows, dtype=torch.long), logits.device)
        out.update(zip(rows, logits.index_select(0, index).to(device)))
    return out


def deferrable(params: list[SamplingParams]) -> bool:
    """Rows ``greedy_on_device`` samples exactly as ``sample`` does (no processing, no grammar
    and no top logprobs, which their callers check): every row greedy."""
    return all(_greedy(p) and not p.top_logprobs for p in params)


def greedy_on_device(logits: torch.Tensor) -> torch.Tensor:
    """``sample``'s all-greedy rows left where the logits are: each row's greedy token and its
    logprob as one float64 ``[2, B]`` tensor (token ids are exact in float64), which the caller
    reads back in one copy when it needs them (``engine.batch.PendingTokens``)."""
    logits = logits.float()
    greedy, norm = argmax_logsumexp(logits)
    return _greedy_pair(logits, greedy, norm)


def _greedy_pair(logits: torch.Tensor, greedy: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    chosen = logprobs_of(logits.gather(1, greedy[:, None]), norm)[:, 0]
    return torch.stack([greedy.double(), chosen.double()])


def top_logprobs(
    scores: torch.Tensor, ks: list[int], norm: Normalizer | None = None
) -> list[TopLogprobs | None]:
    """Per row of ``scores`` [N, V], its ``ks[i]`` best (ids, logprobs), or None for k 0.
    ``scores`` are logprobs, or logits when their rows' normalizer ``norm`` is given."""
    k = max(ks, default=0)
    if k <= 0:
        return [None] * len(ks)
    values, ids = torch.topk(scores, min(k, scores.shape[-1]), dim=-1)
    if norm is not None:
        values = logprobs_of(values, norm)
    values, ids = values.tolist(), ids.tolist()
    return [(ids[i][:n], values[i][:n]) if n > 0 else None for i, n in enumerate(ks)]


def _greedy(p: SamplingParams) -> bool:
    return p.temperature == 0.0 or p.top_k == 1


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    return draw(sampling_probs(on_generator_device(row, gen), p), gen)


def on_generator_device(row: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """``row`` where ``gen`` draws: a request's seeded generator draws on the CPU on any
    device, and its distribution is computed there too (the same bits on every path)."""
    if gen is not None and gen.device != row.device:
        return row.to(gen.device)
    return row


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One token from ``probs`` (``sampling_probs``) with ``gen`` (None: torch's global
    generator): the one call every sampled token goes through, decoding's and a verify step's
    (``speculative.accept_point_drafts``), so both draw the same token from the same state."""
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sampling_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token of ``row`` (fp32 logits ``[V]``) is drawn from:
    temperature, then top-k, min-p and top-p (the kept probabilities, not renormalised:
    ``multinomial`` normalises)."""
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
    return probs
