"""OLMo-Hybrid (allenai/Olmo-Hybrid-7B): Gated DeltaNet layers with full-attention layers among
them (``config.layer_types``: every fourth by default), a SwiGLU MLP in every layer.

The two layer kinds are normed differently, as OLMo's are:
- a Gated DeltaNet layer is pre-norm, as Qwen3-Next's: ``h + gdn(input_norm(h))``, then
  ``h + mlp(post_attention_norm(h))``;
- an attention layer is OLMo-2-style post-norm: ``h + post_attention_norm(attn(h))``, then
  ``h + post_feedforward_norm(mlp(h))``; its q and k are RMS-normed over the whole projection
  (every head together, before the heads are split), then RoPE (none where the config has no
  ``rope_theta``: NoPE).

The Gated DeltaNet is the shared layer (``layers/gated_delta_net.py``) with its ``olmo_hybrid``
projection layout (six linears fused into one ``in_proj``), the output norm's eps of FLA's
fused gated norm (1e-5, as transformers hard-codes it) and, with ``linear_allow_neg_eigval``,
``beta_scale`` 2. Checkpoint names are mapped as transformers maps them (``RENAMES``; the q, k
and v convolutions joined), and the projections fused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mambaradix.layers.gated_delta_net import GDN_MERGES, GatedDeltaNet
from mambaradix.layers.mlp import GATE_UP_MERGE, GatedMLP
from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import Linear
from mambaradix.layers.rotary import RotaryEmbedding
from mambaradix.layout import ForwardContext
from mambaradix.models.base import HybridCausalLM, pool_layer_indices
from mambaradix.models.granite_hybrid import ProjAttention
from mambaradix.models.loader import assign_weights, merge_weights
from mambaradix.models.registry import register_model

# the attention's q/k/v, renamed on load (the Gated DeltaNet's own q/k/v_proj merge otherwise)
ATTN_PARTS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v"}
ATTN_MERGE = {"qkv_proj": tuple(ATTN_PARTS.values())}
# published checkpoints convolve q, k and v with one conv each (transformers joins them too)
CONV_MERGE = {"conv1d": ("q_conv1d", "k_conv1d", "v_conv1d")}
# the published names (transformers renames the same way) -> this module's
RENAMES = {
    "attention_layer_norm": "input_layernorm",
    "feedforward_layer_norm": "post_attention_layernorm",
    "linear_attn.o_norm": "linear_attn.norm",
    "linear_attn.o_proj": "linear_attn.out_proj",
}
GDN_NORM_EPS = 1e-5  # the Gated DeltaNet output norm's (transformers: FLA's default)


class OlmoAttention(ProjAttention):
    """Attention whose q and k are RMS-normed across all heads (``q_norm`` over ``H * D``,
    ``k_norm`` over ``Hkv * D``), then rotated (``ProjAttention.attend``); q/k/v one GEMM
    (``ATTN_MERGE``)."""

    def __init__(self, cfg: Any, attn_layer: int) -> None:
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        super().__init__(cfg.hidden_size, heads, kv_heads, d, attn_layer, d**-0.5,
                         projections=False)  # fmt: skip
        bias = bool(getattr(cfg, "attention_bias", False))
        self.split = [heads * d, kv_heads * d, kv_heads * d]
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.split), bias=bias)
        self.o_proj = Linear(heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(heads * d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(kv_heads * d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rotary, cos_sin) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        out = self.attend(self.q_norm(q), self.k_norm(k), v, ctx, rotary, cos_sin)
        return self.o_proj(out)


class OlmoHybridLayer(nn.Module):
    def __init__(self, cfg: Any, attn_index: int | None, state_index: int | None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.hidden_act)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if attn_index is not None:
            self.self_attn = OlmoAttention(cfg, attn_index)
            self.post_feedforward_layernorm = RMSNorm(h, eps)
        else:
            self.linear_attn = GatedDeltaNet(
                h,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                state_layer=state_index,
                eps=GDN_NORM_EPS,
                layout="olmo_hybrid",
                activation=cfg.hidden_act,
                beta_scale=2.0 if cfg.linear_allow_neg_eigval else 1.0,
            )
            self.input_layernorm = RMSNorm(h, eps)
        self.is_attention = attn_index is not None

    def forward(self, h: torch.Tensor, ctx: ForwardContext, rotary, cos_sin) -> torch.Tensor:
        if self.is_attention:  # post-norm: the norms apply to each branch's output
            h = h + self.post_attention_layernorm(self.self_attn(h, ctx, rotary, cos_sin))
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h, x = self.post_attention_layernorm.add_and_norm(
            h, self.linear_attn(self.input_layernorm(h), ctx)
        )
        return h + self.mlp(x)


def _has_rope(cfg: Any) -> bool:
    """Whether the attention layers rotate (transformers: a ``rope_theta`` in the config's
    ``rope_parameters``; else NoPE)."""
    params = getattr(cfg, "rope_parameters", None)
    return isinstance(params, dict) and params.get("rope_theta") is not None


@register_model("OlmoHybridForCausalLM")
class OlmoHybridForCausalLM(HybridCausalLM):
    """OLMo-Hybrid. Contract: ``models/base.py``."""

    def __init__(self, config: Any, ssm_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_common(config, ssm_dtype)
        kinds = list(config.layer_types)
        unknown = sorted(set(kinds) - {"full_attention", "linear_attention"})
        if unknown:
            raise ValueError(f"OLMo-Hybrid: unsupported layer types {unknown}")
        attn = [k == "full_attention" for k in kinds]
        indices = pool_layer_indices(attn, [not a for a in attn])
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            OlmoHybridLayer(config, a if is_attn else None, None if is_attn else s)
            for (a, s), is_attn in zip(indices, attn)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_lm_head(getattr(config, "tie_word_embeddings", False))
        layers = self.model.layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.rotary = RotaryEmbedding(config, head_dim) if _has_rope(config) else None
        self._init_memory(
            sum(attn), config.num_key_value_heads, head_dim,
            [layer.linear_attn for layer in layers if not layer.is_attention],
        )  # fmt: skip

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.norm

    def body(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos_sin = self.rotary(ctx.layout.positions) if self.rotary is not None else None
        for layer in self.model.layers:
            h = layer(h, ctx, self.rotary, cos_sin)
        return h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed():
            for name, t in self.without_tied_head(weights):
                for old, new in RENAMES.items():
                    name = name.replace(f".{old}.", f".{new}.")
                prefix, _, leaf = name.rpartition(".")
                owner, _, module = prefix.rpartition(".")
                if owner.endswith(".self_attn") and module in ATTN_PARTS:
                    name = f"{owner}.{ATTN_PARTS[module]}.{leaf}"
                yield name, t

        merges = {**GATE_UP_MERGE, **ATTN_MERGE, **GDN_MERGES["olmo_hybrid"], **CONV_MERGE}
        assign_weights(self, merge_weights(renamed(), merges))
