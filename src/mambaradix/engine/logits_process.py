"""Per-request logits processing before sampling: penalties, ``logit_bias``, ``min_tokens``,
a thinking budget (grammar masks are applied to the batch's rows by ``engine.structured``).

A ``RequestLogits`` belongs to one request. It is read and updated only on the runner's
thread: batches run there strictly in order, so when a batch samples for a request, every
token sampled for it by earlier batches has already been ``accept``-ed, overlap or not. A
retracted request keeps its state (its sampled tokens do not change).

Order on a row of raw logits: repetition penalty (prompt and output tokens: positive logits
divided, negative multiplied), frequency and presence penalties (output tokens), logit bias,
the ``min_tokens`` mask of EOS and stop tokens (unless nothing else is left: a grammar
mask, applied to the row before, may allow only EOS); last, a token the thinking budget forces
is the only one left.
"""

from __future__ import annotations

import torch

from mambaradix.core import SamplingParams


class ThinkingBudget:
    """A reply's reasoning, capped (``SamplingParams.thinking_budget``), by token ids: the
    reply opens the block with ``start_ids`` (phase ``start``; any other first token means it
    does not reason: ``done``) or starts inside it (``thinking``); in the block, once
    ``budget`` tokens of reasoning are out, the end tag's tokens are forced, from where the
    reply's own partial tag stands; ``end_ids`` closes it (``done``)."""

    def __init__(
        self, budget: int, start_ids: list[int], end_ids: list[int], thinking: bool
    ) -> None:
        if not start_ids or not end_ids:
            raise ValueError("a thinking budget needs start and end tags of at least one token")
        self.budget = budget
        self.start_ids = list(start_ids)
        self.end_ids = list(end_ids)
        self.phase = "thinking" if thinking else "start"
        self.matched = 0  # tokens of the tag the phase waits for, matched so far
        self.reasoned = 0  # tokens in the block, the end tag's matched part not counted

    def forced(self) -> int | None:
        """The token the next step must be (None: the model's choice)."""
        if self.phase == "thinking" and self.reasoned >= self.budget:
            return self.end_ids[self.matched]
        return None

    def accept(self, token: int) -> None:
        if self.phase == "start":
            if token != self.start_ids[self.matched]:
                self.phase = "done"
                return
            self.matched += 1
            if self.matched == len(self.start_ids):
                self.phase, self.matched = "thinking", 0
        elif self.phase == "thinking":
            tag = self.end_ids
            if token == tag[self.matched]:
                self.matched += 1
                if self.matched == len(tag):
                    self.phase = "done"
                return
            self.reasoned += self.matched  # a false start of the tag was reasoning after all
            self.matched = 0
            if token == tag[0]:
                self.matched = 1
            else:
                self.reasoned += 1


class RequestLogits:
    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        vocab_size: int,
        eos_token_ids: list[int],
        budget: ThinkingBudget | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.budget = budget
        self.repetition = params.repetition_penalty
        self.frequency = params.frequency_penalty
        self.presence = params.presence_penalty
        self.min_tokens = params.min_tokens
        self.num_outputs = 0
        bias = sorted(params.logit_bias.items())
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in bias], dtype=torch.float32)
        self.counts = (
            torch.zeros(vocab_size, dtype=torch.float32)
            if (self.frequency or self.presence)
            else None
        )
        self.seen: torch.Tensor | None = None
        if self.repetition != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        self.stop_ids = torch.tensor(sorted(t for t in stops if 0 <= t < vocab_size))

    def _to(self, device: torch.device) -> None:
        """Keep the request's tensors where its logits are (built on the CPU; moved once)."""
        for name in ("bias_ids", "bias_values", "counts", "seen", "stop_ids"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        """The processed copy of one fp32 row of raw logits."""
        if self.stop_ids.device != row.device:
            self._to(row.device)
        row = row.clone()
        if self.seen is not None:
            picked = row[self.seen]
            row[self.seen] = torch.where(
                picked > 0, picked / self.repetition, picked * self.repetition
            )
        if self.counts is not None:
            row -= self.frequency * self.counts + self.presence * (self.counts > 0).float()
        if self.bias_ids.numel():
            row.index_add_(0, self.bias_ids, self.bias_values)
        if self.num_outputs < self.min_tokens and self.stop_ids.numel():
            kept = row[self.stop_ids]
            row[self.stop_ids] = float("-inf")
            # a grammar that may only end here: it ends (decided where the row is, no read)
            row[self.stop_ids] = torch.where(torch.isfinite(row).any(), row[self.stop_ids], kept)
        forced = self.budget.forced() if self.budget is not None else None
        if forced is not None:
            row.fill_(float("-inf"))
            row[forced] = 0.0
        return row

    def accept(self, token: int) -> None:
        self.num_outputs += 1
        if self.budget is not None:
            self.budget.accept(token)
        if self.counts is not None:
            self.counts[token] += 1.0
        if self.seen is not None:
            self.seen[token] = True
