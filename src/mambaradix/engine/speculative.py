"""Speculative decoding's parts that need no forward: n-gram drafts (prompt lookup) and the
acceptance rules that turn a verified draft into the tokens a request emits.

A verify step scores a request's ``k`` draft tokens ``d_1 .. d_k`` and one more position in one
forward: row ``i`` (``0 <= i <= k``) holds the target's distribution of the token after
``d_1 .. d_i``. Acceptance walks the rows in order and emits ``1 .. k + 1`` tokens:

- greedy: each draft token while it equals the row's argmax, then the argmax of the first row
  that disagrees (or of row ``k``, the bonus token, when all ``k`` agree): exactly the tokens
  greedy decoding without speculation gives;
- sampling (the speculative rejection rule): draft token ``x`` of row ``i``, drawn by the drafter
  from ``q``, is kept with probability ``min(1, p(x) / q(x))``; at the first rejection the
  emitted token is drawn from the residual ``max(p - q, 0)`` normalised, and after ``k`` kept
  tokens the bonus is drawn from row ``k``'s ``p``. Each emitted token is then distributed
  exactly as ``p`` (Leviathan et al. 2023; Chen et al. 2023).
- the engine's drafts are deterministic (n-gram lookups, the MTP head's argmax): ``q`` is a
  point mass on ``x``, the rule keeps ``x`` with probability ``p(x)`` and otherwise draws from
  ``p`` without ``x``, which is drawing ``t`` from ``p`` and keeping ``x`` when ``t == x`` (else
  emitting ``t``). That form is what runs: each emitted token is drawn from its row exactly as
  decoding without speculation draws it (``sampler.draw``, the request's generator, one draw a
  token), so a seeded request emits the same tokens with speculation on and off, whatever the
  drafts, the batch or the step shapes.
"""

from __future__ import annotations

import torch

from mambaradix.engine.sampler import draw
from mambaradix.engine.spec_policy import AdaptiveDrafts

Tensor = torch.Tensor

NGRAM = "NGRAM"
DRAFT_HEAD_ALGORITHMS = ("NEXTN", "MTP")  # one algorithm, SGLang's two names


class NgramDrafter:
    """Draft tokens looked up in a request's own tokens (prompt and output): the tokens that
    followed the most recent earlier occurrence of its last ``n`` tokens, for the largest ``n``
    from ``max_n`` down to ``min_n`` that occurs. The index is built as tokens arrive (each
    ``append`` is O(max_n)); an n-gram's entry is its latest end position."""

    def __init__(self, tokens: list[int] | None = None, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end (inclusive)
        for t in tokens or ():
            self.append(t)

    def append(self, token: int) -> None:
        """Add the next token; the n-grams ending just before it become searchable (the suffix
        a lookup searches for must not find itself)."""
        toks = self.tokens
        end = len(toks) - 1  # n-grams ending at the previous last token
        for n in range(self.min_n, self.max_n + 1):
            if end - n + 1 < 0:
                break
            self._last[tuple(toks[end - n + 1 : end + 1])] = end
        toks.append(token)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (fewer, or none, where no earlier occurrence continues)."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), self.min_n - 1, -1):
            end = self._last.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                return toks[end + 1 : end + 1 + k]
        return []


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """The tokens greedy decoding emits: ``target`` holds the argmax of each of the ``k + 1``
    verified rows (``len(draft) + 1`` of them)."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(draft)} draft tokens need {len(draft) + 1} rows, got {len(target)}")
    out = []
    for d, t in zip(draft, target):
        out.append(t)
        if d != t:
            return out
    out.append(target[len(draft)])
    return out


def accept_sampled(
    draft: list[int],
    target_probs: Tensor,
    generator: torch.Generator | None,
    draft_probs: Tensor | None = None,
) -> list[int]:
    """The tokens the speculative rejection rule emits. ``target_probs`` ``[k + 1, V]``: each
    verified row's sampling distribution (``sampler.sampling_probs``: unnormalised is fine);
    ``draft_probs`` ``[k, V]``: the drafter's distributions, or None for a deterministic draft
    (a point mass on each draft token: ``accept_point_drafts``). Draws come from
    ``generator``: one uniform per kept or rejected draft token, one for the emitted token
    after a rejection or the bonus."""
    k = len(draft)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} draft tokens need {k + 1} rows, got {target_probs.shape[0]}")
    if draft_probs is None:
        return accept_point_drafts(draft, target_probs, generator)
    dev = generator.device if generator is not None else target_probs.device
    p_all = target_probs.to(dev, torch.float64)
    p_all = p_all / p_all.sum(dim=-1, keepdim=True)
    out: list[int] = []
    for i, x in enumerate(draft):
        p = p_all[i]
        q = draft_probs[i].to(dev, torch.float64)
        q = q / q.sum()
        u = float(torch.rand((), generator=generator, device=dev, dtype=torch.float64))
        if q[x] > 0 and u * float(q[x]) < float(p[x]):  # u < p(x) / q(x), without dividing
            out.append(x)
            continue
        residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: a rejection has probability 0 (rounding)
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p_all[k], 1, generator=generator)))
    return out


def accept_point_drafts(
    draft: list[int], target_probs: Tensor, generator: torch.Generator | None
) -> list[int]:
    """The rejection rule for deterministic drafts: row by row, a token drawn from the row as
    decoding without speculation draws it (``sampler.draw``); the draft token is kept when the
    draw is that token, else the draw is emitted and the walk ends (after ``k`` kept tokens the
    bonus row's draw is the last). ``target_probs`` must be the very tensors the sampler would
    draw from (``sampling_probs`` of the same logits, on the generator's device) for the
    tokens to equal decoding's."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        out.append(draw(target_probs[i], generator))
        if i == len(draft) or out[-1] != draft[i]:
            return out
    return out


class Speculation:
    """The scheduler's side of speculative decoding: each decoding request's draft for this
    step, cut so that the cache sees exactly what it sees without speculation.

    A decode forward ending at a *snapshot end* (``--mamba-track-interval`` positions at whole
    pages; with ``extra_buffer`` and pages > 1 every page end) writes a snapshot there. A verify
    step may end anywhere in ``start + 1 .. start + 1 + k``, so a draft is cut to end before the
    next snapshot end, and the step that reaches it is an ordinary decode: snapshots land at the
    same positions, from the same kind of forward, as with speculation off. Drafts are cut
    at the same positions with the cache off, so a step's shape (and with it the random draws
    of a seeded request) never depends on the cache.

    ``draft_head``: the tokens come from the model's MTP head, which the runner chains before
    the verify forward (``engine.mtp_draft``): ``draft`` only decides how many (zeros stand in
    for them); else they are looked up in the request's own tokens (``NgramDrafter``).

    ``max_batch`` (``--speculative-disable-by-batch-size``; 0: no bound): a step with more
    decoding requests drafts for none of them. Which steps verify never changes what a request
    emits (greedy acceptance emits greedy decoding's tokens, sampled acceptance draws each token
    as decoding does), only how many forwards it takes.

    ``adaptive`` (``--speculative-adaptive``): each step verifies at most as many draft tokens
    as ``engine.spec_policy`` expects to pay on this machine, 0 to k."""

    def __init__(
        self,
        k: int,
        min_n: int,
        max_n: int,
        *,
        context_length: int,
        page_size: int,
        track_interval: int,
        page_snapshots: bool,
        draft_head: bool = False,
        max_batch: int = 0,
        adaptive: bool = False,
    ) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.max_batch = max_batch
        self.adaptive = AdaptiveDrafts(k) if adaptive else None
        self.draft_head = draft_head
        self.context_length = context_length
        self.page_size = page_size
        self.track_interval = track_interval
        self.page_snapshots = page_snapshots and page_size > 1

    def drafts_for(self, decoding: int) -> bool:
        """Whether a step of ``decoding`` decoding requests drafts at all."""
        return not self.max_batch or decoding <= self.max_batch

    def draft(self, req) -> list[int]:
        """Draft tokens for ``req`` (a decoding request, nothing in flight), or [] for an
        ordinary decode step."""
        p = req.params
        if req.grammar is not None or req.logits_state is not None or p.top_logprobs:
            return []  # per-token masks, penalties and top-k alternatives: one token a step
        start = req.fed_len  # the position of the token this step feeds
        room = min(
            self.k,
            p.max_new_tokens - req.num_outputs() - 1,  # emitted tokens: up to k + 1
            self.context_length - start - 2,
            self._before_snapshot(start + 1) - start - 2,
        )
        if room < 1:
            return []
        if self.draft_head:
            return [0] * room
        if req.drafter is None:
            req.drafter = NgramDrafter(min_n=self.min_n, max_n=self.max_n)
        drafter: NgramDrafter = req.drafter
        n_known = len(drafter.tokens)
        if n_known < req.seq_len:
            drafter.extend(req.token_slice(n_known, req.seq_len))
        return drafter.propose(room)

    def _before_snapshot(self, first_end: int) -> int:
        """The first decode end ``>= first_end`` that writes a snapshot when the cache is on."""
        page = self.page_size
        steps = []
        if self.page_snapshots:
            steps.append(page)
        interval = self.track_interval * page // _gcd(self.track_interval, page)
        steps.append(interval)
        return min(-(-first_end // s) * s for s in steps)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
