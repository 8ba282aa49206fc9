"""The interface every model implements (the contract between the runner and model code).

A model is an ``nn.Module`` built from a Hugging Face config. It declares what memory it needs
(``kv_spec`` for its attention layers, ``state_spec`` for its recurrent layers, both in layer
order) and computes one forward over a ``ForwardContext``:

- attention layer ``i`` (i-th attention layer of the model) writes the new tokens' K/V into
  ``ctx.kv_pool.k[i][ctx.out_kv_slots]`` and reads each request's K/V through
  ``req.kv_slots``;
- recurrent layer ``j`` starts each request from ``ctx.state_pool.conv[j][state_slot]`` /
  ``temporal[j][state_slot]``, leaves its final state there, and for every ``(n, slot)`` in
  ``req.snapshots`` also writes the state after n new tokens into ``slot``.

It returns next-token logits: ``[num_reqs, vocab]`` for each request's last new token, or
``[num_tokens, vocab]`` for every new token when ``all_logits`` is true.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mambaradix.core import ForwardContext, KVSpec, StateSpec


class HybridModel(Protocol):
    kv_spec: KVSpec
    state_spec: StateSpec
    vocab_size: int

    def forward(self, ctx: ForwardContext, all_logits: bool = False) -> torch.Tensor: ...
