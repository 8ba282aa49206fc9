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

It returns next-token logits at ``ctx.logit_rows()``: each request's last new token, or all
its new tokens where ``ForwardReq.all_logits`` is set (prompt logprobs); ``[num_tokens,
vocab]`` for every new token when the ``all_logits`` argument is true.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from mambaradix.core import ForwardContext, KVSpec, StateSpec


class HybridModel(Protocol):
    kv_spec: KVSpec
    state_spec: StateSpec
    vocab_size: int

    def forward(self, ctx: ForwardContext, all_logits: bool = False) -> torch.Tensor: ...


class HybridCausalLM(torch.nn.Module):
    """Shared plumbing of the model classes: the attributes of the contract above, and the two
    memory specs derived from the model's attention layers and recurrent mixers.

    A subclass calls ``_init_common`` first, and ``_init_memory`` once its layers exist. Every
    recurrent mixer has ``state_layer_spec(conv_dtype, ssm_dtype) -> StateLayerSpec``.
    """

    def _init_common(self, config: Any, ssm_dtype: torch.dtype) -> None:
        self.config = config
        self.ssm_dtype = ssm_dtype
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = config.max_position_embeddings
        eos = getattr(config, "eos_token_id", None)
        self.eos_token_ids = [] if eos is None else (
            list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
        )  # fmt: skip

    def _init_memory(
        self, num_attn: int, kv_heads: int, head_dim: int, mixers: list[torch.nn.Module]
    ) -> None:
        self._attn_shape = (num_attn, kv_heads, head_dim)
        self._mixers = mixers  # plain list: not registered twice as submodules

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def kv_spec(self) -> KVSpec:
        n, heads, dim = self._attn_shape
        return KVSpec(n, heads, dim, dtype=self.dtype)

    @property
    def state_spec(self) -> StateSpec:
        return StateSpec(
            tuple(m.state_layer_spec(self.dtype, self.ssm_dtype) for m in self._mixers)
        )


def pool_layer_indices(is_attention: list[bool], is_state: list[bool]) -> list[tuple[int, int]]:
    """For each decoder layer, ``(attention index, state index)``: its layer in the KV pool and
    in the state pool (each counts only the earlier layers of its kind; a layer may be neither,
    as NemotronH's MLP blocks)."""
    out, attn, state = [], 0, 0
    for a, s in zip(is_attention, is_state):
        out.append((attn, state))
        attn, state = attn + a, state + s
    return out
