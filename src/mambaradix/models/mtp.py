"""The multi-token-prediction (MTP) draft head of Qwen3-Next / Qwen3.5 checkpoints.

Published checkpoints ship it as ``mtp.*`` tensors beside the model's (``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.<j>.*`` named as a
full-attention decoder layer of the model, ``mtp.norm``); the embedding and ``lm_head`` are
the target's. For a row at position p whose next token t is known, with the target's
final-normed hidden state h at p::

    x   = fc(concat(pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h)))   [H] <- [2H]
    x   = decoder layer j (gated full attention at position p, own KV, the model's MLP kind)
    out = norm(x)              -> lm_head(out): logits of the token after t
                               -> the hidden state of the next step (fed with its sampled token)

Every norm is zero-centred (``x * (1 + w)``), as the model's. The layer's attention writes its
K/V into its own attention layer of the KV pool (after the model's), at the same slots as the
target's tokens of the same positions. Sources: SGLang ``models/qwen3_next_mtp.py`` /
``qwen3_5_mtp.py`` and vLLM ``models/qwen3_next_mtp.py`` / ``qwen3_5_mtp.py`` (weight names,
concat order, norms, the target hidden state after its final norm, the output norm feeding the
next step); ``mtp_num_hidden_layers`` from the published Qwen3.5 configs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import Linear
from mambaradix.layout import ForwardContext

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
    each attending in its own KV-pool layer. ``rotary``: the model's RoPE (no parameters)."""

    def __init__(self, cfg: Any, layers: list[nn.Module], rotary: nn.Module) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, zero_centered=True)
        self.rotary = rotary

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(
        self, ctx: ForwardContext, hidden: torch.Tensor, embeds: torch.Tensor, step: int = 0
    ) -> torch.Tensor:
        """``hidden`` and ``embeds`` (of the next tokens) ``[T, H]`` at the layout's rows ->
        the normed output ``[T, H]`` (``HybridCausalLM.draft`` adds the logits)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        cos_sin = self.rotary(ctx.layout.positions)
        x, y = self.layers[step % len(self.layers)](x, ctx, cos_sin)
        return self.norm.add_and_norm(x, y)[1]
