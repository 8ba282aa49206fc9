"""GraniteMoeHybrid (Granite-4.0-H): Mamba2 and attention layers, each followed by a shared MLP
and optionally a top-k MoE; Granite's scalar multipliers on embeddings, residuals, attention
scale and logits.

Parameter names are the checkpoint's (``block_sparse_moe.input_linear.weight`` ``[E, 2I, H]``,
``output_linear.weight`` ``[E, H, I]``, ``router.layer.weight``), so weights load by name.
``ProjAttention`` (q/k/v/o projections + optional RoPE over the pooled KV) is shared with
NemotronH.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mambaradix.layers.attention import pooled_attention
from mambaradix.layers.mamba2 import Mamba2Mixer
from mambaradix.layers.mlp import activation
from mambaradix.layers.moe import expert_weights, experts_forward
from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import KernelUser, Linear
from mambaradix.layers.rotary import RotaryEmbedding
from mambaradix.layout import ForwardContext
from mambaradix.models.base import HybridCausalLM, pool_layer_indices
from mambaradix.models.loader import assign_weights
from mambaradix.models.registry import register_model

logger = logging.getLogger(__name__)

MAMBA, ATTENTION = "linear_attention", "full_attention"
_LEGACY_TYPES = {"mamba": MAMBA, "attention": ATTENTION, "M": MAMBA, "*": ATTENTION}


def layer_kinds(config: Any) -> list[str]:
    """Per-layer block kinds (``linear_attention`` / ``full_attention`` / ``mlp`` / ``moe``)."""
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    return [_LEGACY_TYPES.get(k, k) for k in kinds]


class ProjAttention(KernelUser, nn.Module):
    """Grouped-query attention with ``q_proj/k_proj/v_proj/o_proj`` over the pooled KV.

    ``attn_index`` is this layer's index among the model's attention layers (its KV pool layer);
    ``rotary`` None means no positional encoding (NemotronH, Granite with ``nope``);
    ``projections`` False: no projections of its own (a model that fuses them with another
    layer's calls ``attend``).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        attn_index: int,
        scale: float,
        bias: bool = False,
        projections: bool = True,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attn_index = attn_index
        self.scale = scale
        if projections:
            self.q_proj = Linear(hidden, num_heads * head_dim, bias=bias)
            self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias)
            self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias)
            self.o_proj = Linear(num_heads * head_dim, hidden, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        rotary: RotaryEmbedding | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.attend(q, k, v, ctx, rotary, cos_sin))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        rotary: RotaryEmbedding | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Attention over the projected ``q`` ``[T, heads * head_dim]``, ``k`` and ``v``
        (``[T, kv_heads * head_dim]``; rows may be strided) -> ``[T, heads * head_dim]``,
        before ``o_proj``."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if rotary is not None and cos_sin is not None:
            q, k = rotary.apply(q, *cos_sin), rotary.apply(k, *cos_sin)
        out = pooled_attention(self.ops, ctx, self.attn_index, q, k, v, self.scale)
        return out.reshape(t, -1)


class _Weight(nn.Module):
    """A bare ``weight`` parameter: a stack of expert weights (checkpoint names like
    ``input_linear.weight`` on 3-D), in the layout of ``moe.expert_weights``."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = expert_weights(num_experts, out_features, in_features)
        with torch.no_grad():
            self.weight.normal_(std=0.02)

    def expert_stacks(self) -> tuple[str, ...]:
        return ("weight",)


class GraniteSharedMLP(KernelUser, nn.Module):
    """``output_linear(act(a) * b)`` with ``[a | b] = input_linear(x)``: the backend's
    ``gated_mlp``."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.input_linear = Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = Linear(intermediate, hidden, bias=False)
        activation(act)  # an unsupported name fails here, at build
        self.act_name = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_mlp(
            x, self.input_linear.weight, self.output_linear.weight, self.act_name
        )


class _Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = Linear(hidden, num_experts, bias=False)
        self.layer.quantizable = False  # routing stays exact (as FP8 checkpoints keep it)


class GraniteMoE(KernelUser, nn.Module):
    """Top-k routed gated experts: softmax over the k largest router logits."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = _Router(hidden, num_experts)
        self.input_linear = _Weight(num_experts, 2 * intermediate, hidden)
        self.output_linear = _Weight(num_experts, hidden, intermediate)
        activation(act)  # an unsupported name fails here, at build
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, top_idx = self.router.layer(x).float().topk(self.top_k, dim=-1)
        top_w = torch.softmax(top_logits, dim=-1).to(x.dtype)
        return experts_forward(
            x,
            top_w,
            top_idx,
            self.input_linear.weight,
            self.output_linear.weight,
            self.act,
            self.ops,
        )


class GraniteHybridLayer(nn.Module):
    def __init__(self, config: Any, kind: str, attn_index: int, state_index: int) -> None:
        super().__init__()
        h = config.hidden_size
        eps = config.rms_norm_eps
        self.kind = kind
        self.residual_multiplier = float(config.residual_multiplier)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(
                h,
                config.mamba_n_heads,
                config.mamba_d_head,
                config.mamba_n_groups,
                config.mamba_d_state,
                config.mamba_d_conv,
                state_index,
                conv_bias=config.mamba_conv_bias,
                proj_bias=config.mamba_proj_bias,
                norm_eps=eps,
                dt_limit=tuple(config.time_step_limit),
                activation=config.hidden_act,
            )
        else:
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.self_attn = ProjAttention(
                h,
                config.num_attention_heads,
                config.num_key_value_heads,
                head_dim,
                attn_index,
                float(config.attention_multiplier),
                bias=config.attention_bias,
            )
        self.block_sparse_moe = (
            GraniteMoE(
                h,
                config.intermediate_size,
                config.num_local_experts,
                config.num_experts_per_tok,
                config.hidden_act,
            )
            if config.num_local_experts > 0
            else None
        )
        self.shared_mlp = GraniteSharedMLP(h, config.shared_intermediate_size, config.hidden_act)

    def forward(self, h, ctx: ForwardContext, rotary, cos_sin, pending=None):
        """``pending``: the previous layer's feed-forward output, not yet in ``h`` (its residual
        add is fused with this layer's first norm). Returns ``(h, y)``: this layer's own
        feed-forward output left pending for the next one (``residual_multiplier`` is one
        config value for every layer)."""
        if pending is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add_and_norm(h, pending, self.residual_multiplier)
        if self.kind == MAMBA:
            x = self.mamba(x, ctx)
        else:
            x = self.self_attn(x, ctx, rotary, cos_sin)
        h, x = self.post_attention_layernorm.add_and_norm(h, x, self.residual_multiplier)
        y = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            y = y + self.block_sparse_moe(x)
        return h, y


class _GraniteBody(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        kinds = layer_kinds(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        idx = pool_layer_indices([k == ATTENTION for k in kinds], [k == MAMBA for k in kinds])
        self.layers = nn.ModuleList(
            GraniteHybridLayer(config, kind, a, s) for kind, (a, s) in zip(kinds, idx)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@register_model("GraniteMoeHybridForCausalLM")
class GraniteHybridForCausalLM(HybridCausalLM):
    """Granite-4.0-H. Contract: ``models/base.py``."""

    def __init__(self, config: Any, ssm_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_common(config, ssm_dtype)
        self.model = _GraniteBody(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_lm_head(getattr(config, "tie_word_embeddings", False))
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        attn = [m.self_attn for m in self.model.layers if m.kind == ATTENTION]
        head_dim = attn[0].head_dim if attn else 1
        mambas = [m.mamba for m in self.model.layers if m.kind == MAMBA]
        self._init_memory(len(attn), config.num_key_value_heads, head_dim, mambas)
        self.rotary = (
            RotaryEmbedding(config, head_dim)
            if getattr(config, "position_embedding_type", None) == "rope" and attn
            else None
        )

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.norm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        assign_weights(self, self.without_tied_head(weights))

    def body(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos_sin = self.rotary(ctx.layout.positions) if self.rotary is not None else None
        pending = None
        for layer in self.model.layers:
            h, pending = layer(h, ctx, self.rotary, cos_sin, pending)
        return h + pending * self.model.layers[-1].residual_multiplier
