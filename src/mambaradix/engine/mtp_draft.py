"""Draft tokens from the checkpoint's MTP head (``--speculative-algorithm NEXTN`` / ``MTP``).

The scheduler decides which decoding requests verify a draft this step and how many tokens
each drafts (``Speculation.draft``: zeros stand in for the tokens); the runner calls
``DraftHead.fill`` before the verify forward, which chains the head for those requests:

    step 0     row (h_{c-1}, t_c)     at position c      -> argmax: d_1
    step s     row (o_{s-1}, d_s)     at position c + s  -> argmax: d_{s+1}

where t_c is the request's last token (the one the verify feeds first), h_{c-1} the target's
hidden state before it (the head's state layer, at the working slot: ``MtpHead.extend`` keeps
it there) and o_{s-1} the head's own output of the step before. Each step writes the head's K/V
into the slot of its position, which is the verify's slot of the same token: the verify forward
then rewrites the head's K/V of every token it feeds from the target's hidden states, so what
the cache keeps never holds a draft step's K/V. Draft steps touch neither the state pool nor the
target's KV layers, and run no deferred state operation (the forward after them does, once).

Draft steps of up to ``graph_max_bs`` requests are recorded and replayed as decode steps are
(``engine.step_graph``: ``_DraftStep`` reads its hidden input from, and leaves its output in,
buffers of its batch size, so a replay's only other inputs are the layout's tensors); a head of
several layers (one per step) runs the Python path.

A draft is the head's argmax at each step (a point mass: ``accept_sampled`` with no draft
distribution), so it depends only on the request's tokens: cache on or off, the same drafts.
With a token map (``--speculative-token-map``) the argmax is over the listed tokens only: a
draft step then reads those rows of ``lm_head``, the largest part of the head's weights at
real vocabularies (248k rows against one decoder layer for Qwen3.5).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mambaradix.core import ForwardReq
from mambaradix.engine.batch import RunBatch
from mambaradix.engine.step_graph import DecodeGraphs
from mambaradix.kernels.backend import KernelBackend
from mambaradix.layers.ops import Linear
from mambaradix.layout import ForwardContext, ForwardLayout


class DraftHead:
    """Contract: ``fill(batch)`` replaces the stand-in tokens of every draft in ``batch.drafts``
    (in place, so the scheduler's entries see them) and the verify forward's input ids with the
    head's chained argmax tokens. Counts its forwards in ``forwards`` and rows in ``rows``.
    ``token_map``: the path of a JSON list of token ids to draft from (all tokens: "").
    ``graph_max_bs``: replay draft steps of up to that many requests (0: never)."""

    def __init__(
        self, model: torch.nn.Module, kv_pool: object, state_pool: object, backend: KernelBackend,
        device: str | torch.device, token_map: str = "", graph_max_bs: int = 0,
    ) -> None:  # fmt: skip
        if getattr(model, "mtp", None) is None:
            raise ValueError(
                "--speculative-algorithm NEXTN / MTP drafts with the model's MTP head, but the "
                "model was loaded without it (load_model(..., mtp=True))"
            )
        self.model = model
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.backend = backend
        self.device = device
        self.forwards = 0
        self.rows = 0
        self.token_ids: torch.Tensor | None = None  # the token map: row i drafts token_ids[i]
        self.head: Linear | None = None  # those rows of lm_head
        if token_map:
            self.token_ids = read_token_map(token_map, model.vocab_size).to(device)
            weight = model.lm_head.weight
            self.head = Linear(weight.shape[1], len(self.token_ids), bias=False)
            self.head.weight = torch.nn.Parameter(
                weight.detach().index_select(0, self.token_ids).contiguous(), requires_grad=False
            )
            self.head.bind_ops(backend)
        self._carry: dict = {}  # ForwardLayout.carry of the draft steps (their own plans)
        self.step = _DraftStep(model, self.head)
        self.graphs: DecodeGraphs | None = None
        if graph_max_bs > 0 and model.mtp.num_layers == 1:
            self.graphs = DecodeGraphs(self.step, backend, kv_pool, state_pool, graph_max_bs)

    @torch.inference_mode()
    def fill(self, batch: RunBatch) -> None:
        if not batch.drafts:
            return
        fb = batch.forward
        drafts = list(batch.drafts.values())
        verifies = [fb.reqs[batch.sample_rows[i]] for i in batch.drafts]
        pool = self.state_pool.conv[self.model.mtp.state_layer]
        slots = torch.tensor([r.state_slot for r in verifies], dtype=torch.long, device=pool.device)
        hidden = pool.index_select(0, slots)
        tokens = [r.input_ids[0] for r in verifies]
        active = list(range(len(verifies)))
        step = 0
        while active:
            reqs = [
                ForwardReq(
                    prefix_len=verifies[a].prefix_len + step,
                    input_ids=[tokens[a]],
                    kv_slots=verifies[a].kv_slots,
                    state_slot=verifies[a].state_slot,
                )
                for a in active
            ]
            layout = ForwardLayout.build(reqs, self.device, carry=self._carry)
            self.backend.prepare(layout)
            ctx = ForwardContext(layout, self.kv_pool, self.state_pool)
            if self.graphs is not None:
                self.step.input(len(active), hidden)
                logits = self.graphs.forward(ctx)
                if logits is None:
                    logits = self.step(ctx)
                out = self.step.output(len(active))
            else:
                out, logits = self.model.draft(
                    ctx, hidden, layout.input_ids, step=step, head=self.head
                )
            self.forwards += 1
            self.rows += len(active)
            best = logits.argmax(dim=-1)
            if self.token_ids is not None:
                best = self.token_ids.index_select(0, best)
            picked = best.tolist()
            keep = []
            for row, a in enumerate(active):
                drafts[a][step] = tokens[a] = picked[row]
                if step + 1 < len(drafts[a]):
                    keep.append(row)
            if len(keep) < len(active):
                out = out[keep]
                active = [active[row] for row in keep]
            hidden = out
            step += 1
        for req, draft in zip(verifies, drafts):
            req.input_ids[1:] = draft


class _DraftStep(torch.nn.Module):
    """One chained step of a one-layer head as a forward a step graph records: its hidden
    input is read from, and its output left in, buffers of the batch size (registered, so a
    graph holds them; ``input`` fills one, ``output`` is valid until the next step of that
    size); returns the logits."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module | None) -> None:
        super().__init__()
        self.model = model
        self.head = head
        self._sizes: set[int] = set()

    def input(self, n: int, hidden: torch.Tensor) -> None:
        if n not in self._sizes:
            self._sizes.add(n)
            self.register_buffer(f"hidden_in_{n}", torch.empty_like(hidden), persistent=False)
            self.register_buffer(f"hidden_out_{n}", torch.empty_like(hidden), persistent=False)
        getattr(self, f"hidden_in_{n}").copy_(hidden)

    def output(self, n: int) -> torch.Tensor:
        return getattr(self, f"hidden_out_{n}")

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        n = ctx.layout.num_tokens
        hidden = getattr(self, f"hidden_in_{n}")
        out, logits = self.model.draft(ctx, hidden, ctx.layout.input_ids, head=self.head)
        self.output(n).copy_(out)
        return logits


def read_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The token ids a ``--speculative-token-map`` file lists (a JSON array of distinct ints
    in ``[0, vocab_size)``), checked: a ValueError names the flag and what is wrong."""
    flag = f"--speculative-token-map {path}"
    if Path(path).suffix in (".pt", ".pth", ".bin", ".pkl"):
        raise ValueError(
            f"{flag}: pickled files are not read; give a JSON list of token ids (e.g. from a "
            "tensor t: json.dump(t.tolist(), open('map.json', 'w')))"
        )
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read a JSON list of token ids ({e})") from None
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise ValueError(f"{flag}: expected a non-empty JSON list of integer token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{flag}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{flag}: token ids repeat")
    return torch.tensor(ids, dtype=torch.long)
