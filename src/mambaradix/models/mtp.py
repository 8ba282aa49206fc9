"""The multi-token-prediction (MTP) draft head of Qwen3-Next / Qwen3.5 checkpoints.

Published checkpoints ship it as ``mtp.*`` tensors beside the model's (``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.<j>.*`` named as a
full-attention decoder layer of the model, ``mtp.norm``); the embedding and ``lm_head`` are
the target's. A row pairs a token t with the target's final-normed hidden state h at the
position before it::

    x   = fc(concat(pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h)))   [H] <- [2H]
    x   = decoder layer j (gated full attention, own KV, the model's MLP kind)
    out = norm(x)              -> lm_head(out): logits of the token after t
                               -> the hidden state of the next step (fed with its draft token)

Every norm is zero-centred (``x * (1 + w)``), as the model's. Sources: SGLang
``models/qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` and vLLM ``models/qwen3_next_mtp.py`` /
``qwen3_5_mtp.py`` (weight names, concat order, norms, the target hidden state after its final
norm, the output norm feeding the next step); ``mtp_num_hidden_layers`` from the published
Qwen3.5 configs.

**Where its K/V and its input live (the engine's convention).** The head's attention layers
come after the model's in the KV pool, and the head's K/V *of token q* (row ``(h_{q-1}, t_q)``
at position q) sits in token q's KV slot. So the head's K/V of a token depends only on the
tokens up to it, as the target's does: a prefix the radix cache hands out carries exact head
K/V too (the peers' layout, row ``(h_p, t_{p+1})`` at p's slot, leaves the last cached
position holding the next token of whichever request wrote it). Token 0's row pairs it with a
zero hidden state (a fresh state slot). RoPE sees the same distances as the peers' layout; the
one difference is that extra first key.

The head is also a recurrent layer of the model: its state is the target's hidden state at a
sequence's last token (``state_layer_spec``: one ``[H]`` row in the state pool, in the model's
dtype). Every target forward ends with ``extend``: the head's rows for every new token (K/V
written) and the hidden state left in the working slot and every snapshot slot, like any
recurrent layer's state. A prefix resumed from the cache thus has the hidden state its first
new token's row needs, and a verify step's per-position state slots roll it back with the
rest (``engine.mtp_draft`` runs the draft steps).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mambaradix.core import StateLayerSpec
from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import Linear
from mambaradix.layout import ForwardContext, ForwardLayout

MTP_PREFIXES = ("mtp.", "model.mtp.")


def is_mtp_weight(name: str) -> bool:
    """A checkpoint tensor of the MTP head (``mtp.*``; ``model.mtp.*`` in some conversions)."""
    return name.startswith(MTP_PREFIXES)


def mtp_weight_name(name: str) -> str:
    """The head's tensor name under the model's ``mtp`` submodule."""
    return "mtp." + name.removeprefix("model.").removeprefix("mtp.")


def mtp_num_layers(cfg: Any) -> int:
    """How many MTP layers the config declares: ``mtp_num_hidden_layers`` (Qwen3.5's published
    configs), ``num_nextn_predict_layers`` (vLLM's name), else 1 (Qwen3-Next's configs declare
    none; SGLang and vLLM build one layer)."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        n = getattr(cfg, key, None)
        if n:
            return int(n)
    return 1


def check_mtp_supported(cfg: Any, names: Iterable[str], folder: str) -> None:
    """Raise a ValueError naming the fix when the checkpoint cannot run its MTP head here."""
    if not any(is_mtp_weight(n) for n in names):
        raise ValueError(
            f"speculative decoding with the MTP head (--speculative-algorithm NEXTN / MTP) "
            f"needs the checkpoint's multi-token-prediction weights, but {folder} has no mtp.* "
            "weights; use a checkpoint that ships them (the original release; some conversions "
            "drop them) or run without --speculative-algorithm"
        )
    if getattr(cfg, "mtp_use_dedicated_embeddings", False):
        raise ValueError(
            f"{folder}: mtp_use_dedicated_embeddings is true, an MTP head with its own "
            "embedding, which is not supported (published Qwen3-Next / Qwen3.5 heads share the "
            "model's); run without --speculative-algorithm"
        )


class MtpHead(nn.Module):
    """The head's own modules, named as in the checkpoint under ``mtp.``.

    ``layers``: decoder layers whose ``layer(x, ctx, cos_sin)`` returns ``(x, y)``, the residual
    stream after attention and the MLP's output not yet added (``qwen3_next.DecoderLayer``),
    each attending in its own KV-pool layer. ``rotary``: the model's RoPE (no parameters).
    ``state_layer``: the head's layer in the state pool (after the model's recurrent layers)."""

    def __init__(
        self, cfg: Any, layers: list[nn.Module], rotary: nn.Module, state_layer: int
    ) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_size = hidden
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, zero_centered=True)
        self.rotary = rotary
        self.state_layer = state_layer

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def state_layer_spec(self, dtype: torch.dtype, ssm_dtype: torch.dtype) -> StateLayerSpec:
        """The head's state: the target's last hidden state, ``[H]`` in the model's dtype."""
        return StateLayerSpec(conv_shape=(self.hidden_size,), conv_dtype=dtype)

    def forward(
        self, ctx: ForwardContext, hidden: torch.Tensor, embeds: torch.Tensor, step: int = 0
    ) -> torch.Tensor:
        """``hidden`` and ``embeds`` (of the rows' tokens) ``[T, H]`` at the layout's rows ->
        the normed output ``[T, H]`` (``HybridCausalLM.draft`` adds the logits)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        cos_sin = self.rotary(ctx.layout.positions)
        x, y = self.layers[step % len(self.layers)](x, ctx, cos_sin)
        return self.norm.add_and_norm(x, y)[1]

    def extend(self, ctx: ForwardContext, normed: torch.Tensor, embeds: torch.Tensor) -> None:
        """After the target's forward over ``ctx`` (``normed``: its final-normed hidden state of
        every row, ``embeds`` of every row's token): the head's row of every new token (its K/V
        into the token's slot; the output is not needed), then the hidden state after each
        request's last new token into its working slot and after each snapshot's into the
        snapshot slot. A row's hidden input is the row before's, or for a request's first new
        token the working slot's (the state at its prefix). Decode and verify steps read and
        write through the layout's own tensors (a step graph replays them)."""
        pool = ctx.state_pool.conv[self.state_layer]
        layout, dec = ctx.layout, ctx.layout.decode
        if layout.prefill is None and dec is not None and dec.rows.whole and not dec.num_copies:
            start = pool.index_select(0, dec.state_slots).to(normed.dtype)
            if not dec.multi:  # one row per request, in slot order
                self(ctx, start, embeds)
                pool.index_copy_(0, dec.state_slots, normed.to(pool.dtype))
                return
            # verify steps: each position's state slot (row_slots) keeps its hidden state
            before = torch.cat([normed.new_zeros(1, normed.shape[1]), normed[:-1]])
            before.index_copy_(0, dec.cu[:-1], start)
            self(ctx, before, embeds)
            pool.index_copy_(0, dec.row_slots, normed.to(pool.dtype))
            return
        first_rows, first_slots, out_rows, out_slots = hidden_rows(layout)
        before = torch.cat([normed.new_zeros(1, normed.shape[1]), normed[:-1]])
        before.index_copy_(0, first_rows, pool.index_select(0, first_slots).to(normed.dtype))
        self(ctx, before, embeds)
        pool.index_copy_(0, out_slots, normed.index_select(0, out_rows).to(pool.dtype))


def hidden_rows(layout: ForwardLayout) -> tuple[torch.Tensor, ...]:
    """``(first_rows, first_slots, out_rows, out_slots)`` of a forward: each request's first
    row and working slot (where its first row's hidden input is read), and the row whose hidden
    state each working slot and snapshot slot keeps."""
    first_rows, first_slots, out_rows, out_slots = [], [], [], []
    for r, start in zip(layout.reqs, layout.starts):
        first_rows.append(start)
        first_slots.append(r.state_slot)
        out_rows.append(start + r.extend_len - 1)
        out_slots.append(r.state_slot)
        for n, slot in r.snapshots:
            out_rows.append(start + n - 1)
            out_slots.append(slot)
    dev = layout.device

    def long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=dev)

    return long(first_rows), long(first_slots), long(out_rows), long(out_slots)
