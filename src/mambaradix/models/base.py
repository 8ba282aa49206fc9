"""The interface every model implements (the contract between the runner and model code).

A model is an ``nn.Module`` built from a Hugging Face config. It declares what memory it needs
(``kv_spec`` for its attention layers, ``state_spec`` for its recurrent layers, both in layer
order) and computes one forward over a ``ForwardContext`` (layout + pools):

- attention layer ``i`` (i-th attention layer of the model) writes the new tokens' K/V into
  ``ctx.kv_pool.k[i]`` at ``layout.out_kv_slots`` and reads each request's K/V through its KV
  slots;
- recurrent layer ``j`` starts each request from ``ctx.state_pool.conv[j][state_slot]`` /
  ``temporal[j][state_slot]``, leaves its final state there, and for every ``(n, slot)`` in
  ``req.snapshots`` also writes the state after n new tokens into ``slot``.

It returns fp32 next-token logits at ``layout.logit_rows``: each request's last new token, or
all its new tokens where ``ForwardReq.all_logits`` is set (prompt logprobs); ``[num_tokens,
vocab]`` for every new token when the ``all_logits`` argument is true. Layers call their ops on
the backend the model is bound to (``use_backend``).

Speculative decoding with a model's MTP head (``models/mtp.py``, loaded with
``load_model(..., mtp=True)``): every forward also runs the head's rows of its new tokens and
keeps the last hidden state in the head's state layer (``MtpHead.extend``); ``return_hidden=True``
also returns the final-normed hidden state of every row; ``draft(ctx, hidden, ids)`` runs the
head over a layout (a chained draft step's) and returns its hidden states and logits. The
head's attention layers come after the model's in the KV pool (``kv_spec`` counts them), its
state layer after the model's recurrent layers (``state_spec``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from mambaradix.core import KVSpec, StateSpec
from mambaradix.kernels.backend import KernelBackend
from mambaradix.layers.ops import KernelUser
from mambaradix.layout import ForwardContext


class HybridCausalLM(torch.nn.Module):
    """The one head of every model class (embed -> decoder body -> the logit rows -> final
    norm -> ``lm_head``), the attributes of the contract above, and the two memory specs derived
    from the model's attention layers and recurrent mixers.

    A subclass calls ``_init_common`` first, and ``_init_memory`` once its layers exist; it
    provides ``embedding`` and ``final_norm`` (its own modules, named as in its checkpoints),
    ``lm_head`` and ``body(x, ctx)``; Granite-style scalars go in ``embedding_multiplier`` and
    ``logits_scaling``. Every recurrent mixer has ``state_layer_spec(conv_dtype, ssm_dtype)``.
    """

    # the decode forward reads the batch only through the layout's tensors (never its Python
    # lists), so the runner may record a decode step and replay it (engine.step_graph)
    replayable_decode: bool = True
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    tie_word_embeddings: bool = False

    @property
    def embedding(self) -> torch.nn.Embedding:
        raise NotImplementedError

    @property
    def final_norm(self) -> torch.nn.Module:
        raise NotImplementedError

    def body(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The decoder layers over the packed hidden states ``[T, hidden]``."""
        raise NotImplementedError

    @torch.inference_mode()
    def forward(
        self, ctx: ForwardContext, all_logits: bool = False, return_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits at the layout's logit rows (every row with ``all_logits``). With
        ``return_hidden``: ``(logits, hidden)``, ``hidden`` ``[T, hidden_size]`` the final-normed
        hidden state of every row (what ``lm_head`` reads; an MTP draft head's input, ``draft``);
        the logits are the same either way."""
        layout = ctx.layout
        x = self.embedding(layout.input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        x = self.body(x, ctx)
        if self.mtp is not None:  # every row's hidden state feeds the head
            hidden = self.final_norm(x)
            self.mtp.extend(ctx, hidden, self.embedding(layout.input_ids))
            rows = hidden
            if not all_logits and layout.logit_rows is not None:
                rows = hidden.index_select(0, layout.logit_rows)
            logits = self.project(rows)
            return (logits, hidden) if return_hidden else logits
        rows = x
        if not all_logits and layout.logit_rows is not None:
            rows = x.index_select(0, layout.logit_rows)
        normed = self.final_norm(rows)
        logits = self.project(normed)
        if not return_hidden:
            return logits
        return logits, normed if rows is x else self.final_norm(x)

    def project(self, normed: torch.Tensor, head: torch.nn.Module | None = None) -> torch.Tensor:
        """fp32 logits of final-normed hidden states (``lm_head``, or ``head``: some of its
        rows; Granite's scaling)."""
        logits = (head or self.lm_head)(normed).float()
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits

    @torch.inference_mode()
    def draft(
        self,
        ctx: ForwardContext,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        all_logits: bool = False,
        step: int = 0,
        head: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the multi-token-prediction head (``models/mtp.py``; the model loaded
        with ``load_model(..., mtp=True)``) over the layout's rows: row i at position
        ``positions[i]`` pairs token ``next_ids[i]`` with ``hidden[i]``, the hidden state of the
        token before it (the target's final-normed one, ``forward(..., return_hidden=True)``,
        or the previous step's ``hidden_out``). Writes the head's K/V at the layout's
        ``out_kv_slots`` in its own attention layer(s) of the KV pool. Returns ``(hidden_out
        [T, hidden_size], logits)``: the next step's ``hidden`` for every row, and fp32 logits
        of the token after ``next_ids`` at the logit rows (every row with ``all_logits``).
        ``step`` picks the head's layer (``step % num_mtp_layers``) when it has several;
        ``head``: the logits of only some tokens (a module holding those rows of ``lm_head``)."""
        if self.mtp is None:
            raise ValueError(
                f"{type(self).__name__} was loaded without its MTP head; load it with "
                "load_model(..., mtp=True) (--speculative-algorithm NEXTN)"
            )
        layout = ctx.layout
        out = self.mtp(ctx, hidden, self.embedding(next_ids), step)
        rows = out
        if not all_logits and layout.logit_rows is not None:
            rows = out.index_select(0, layout.logit_rows)
        return out, self.project(rows, head)

    def use_backend(self, backend: KernelBackend) -> None:
        """Bind every module that calls kernel ops to ``backend`` (the engine's)."""
        self.backend = backend
        for module in self.modules():
            if isinstance(module, KernelUser):
                module.bind_ops(backend)

    def tie_lm_head(self, tied: bool) -> None:
        """Share ``lm_head``'s weight with the input embedding (``tie_word_embeddings``)."""
        self.tie_word_embeddings = bool(tied)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embedding.weight

    def without_tied_head(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors less ``lm_head.weight`` when it is tied (some checkpoints
        store the shared tensor twice)."""
        for name, t in weights:
            if not (self.tie_word_embeddings and name == "lm_head.weight"):
                yield name, t

    def _init_common(self, config: Any, ssm_dtype: torch.dtype) -> None:
        self.config = config
        self.ssm_dtype = ssm_dtype
        self.mtp: torch.nn.Module | None = None  # the draft head, where asked (models/mtp.py)
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
