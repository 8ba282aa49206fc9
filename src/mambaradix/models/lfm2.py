"""LFM2: gated short-convolution layers and attention layers (QK-norm, RoPE), each followed by a
SwiGLU feed-forward; pre-norm residual blocks; the final norm is ``embedding_norm``. LFM2-MoE:
the same layers, the feed-forward of every layer past the first ``num_dense_layers`` a sparse
mixture of SwiGLU experts (sigmoid router, experts chosen with a per-expert bias, no shared
expert).

Parameter names are the checkpoint's (``operator_norm``, ``ffn_norm``, ``feed_forward.w1/w2/w3``,
``self_attn.out_proj``, ``conv.in_proj``, ``feed_forward.gate`` / ``expert_bias``), so weights
load by name; LFM2-MoE's per-expert ``experts.{e}.w1/w3/w2`` are stacked into
``experts.gate_up_proj`` / ``down_proj`` while loading.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mambaradix.layers.attention import pooled_attention
from mambaradix.layers.moe import Experts, KeepsFloat32
from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import KernelUser, Linear
from mambaradix.layers.rotary import RotaryEmbedding
from mambaradix.layers.short_conv import ShortConv
from mambaradix.layout import ForwardContext
from mambaradix.models.base import HybridCausalLM, pool_layer_indices
from mambaradix.models.loader import assign_weights, merge_weights
from mambaradix.models.registry import register_model
from mambaradix.models.weights import W123_EXPERTS, stack_expert_weights

logger = logging.getLogger(__name__)


def ff_dim(config: Any) -> int:
    """The feed-forward width after LFM2's optional auto-adjustment."""
    dim = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        dim = int(2 * dim / 3)
        mult = getattr(config, "block_ffn_dim_multiplier", None)
        if mult is not None:
            dim = int(mult * dim)
            m = config.block_multiple_of
            dim = m * ((dim + m - 1) // m)
    return dim


FF_MERGE = {"w13": ("w1", "w3")}


class Lfm2FeedForward(KernelUser, nn.Module):
    """``w2(silu(w1 x) * w3 x)``, HF's ``w1`` and ``w3`` stacked as ``w13`` at load (one GEMM,
    ``FF_MERGE``): the backend's ``gated_mlp``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w13 = Linear(hidden, 2 * intermediate, bias=False)
        self.w2 = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gated_mlp(x, self.w13.weight, self.w2.weight, "silu")


class Lfm2MoeRouter(nn.Module):
    """The router's ``[E, H]`` weight (the checkpoint's ``feed_forward.gate.weight``)."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))


class Lfm2SparseMoe(KeepsFloat32):
    """LFM2-MoE's feed-forward: scores ``sigmoid(gate x)`` in the model's dtype; the top-k
    experts by score plus ``expert_bias`` (fp32, whatever the model dtype, as transformers keeps
    it); their weights the unbiased scores, renormalised when ``norm_topk_prob`` (a 1e-6 floor),
    times ``routed_scaling_factor``; gated SiLU experts."""

    fp32_params = ("expert_bias",)

    def __init__(self, config: Any) -> None:
        super().__init__()
        e, h = config.num_experts, config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.scaling = float(config.routed_scaling_factor)
        self.gate = Lfm2MoeRouter(e, h)
        self.experts = Experts(e, h, config.moe_intermediate_size, "silu")
        self.expert_bias = (
            nn.Parameter(torch.zeros(e), requires_grad=False) if config.use_expert_bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x, self.gate.weight).sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        ids = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.normalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-6)
        return self.experts(x, w * self.scaling, ids)


class Lfm2Attention(KernelUser, nn.Module):
    """GQA with per-head RMSNorm on q and k before RoPE, over the pooled KV."""

    def __init__(self, config: Any, attn_index: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.num_heads
        self.attn_index = attn_index
        self.q_proj = Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.out_proj = Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        rotary: RotaryEmbedding,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        qn, kn = self.q_layernorm, self.k_layernorm
        if rotary.interleaved:
            q, k = rotary.apply(qn(q), *cos_sin), rotary.apply(kn(k), *cos_sin)
        else:  # the norm and the rotation in one op (as Qwen3.5's)
            q = self.ops.rms_norm_rope(q, qn.weight, qn.eps, qn.zero_centered, *cos_sin)
            k = self.ops.rms_norm_rope(k, kn.weight, kn.eps, kn.zero_centered, *cos_sin)
        out = pooled_attention(self.ops, ctx, self.attn_index, q, k, v, self.head_dim**-0.5)
        return self.out_proj(out.reshape(t, -1))


class Lfm2Layer(nn.Module):
    def __init__(
        self, config: Any, is_attention: bool, attn_index: int, state_index: int, moe: bool
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.is_attention = is_attention
        if is_attention:
            self.self_attn = Lfm2Attention(config, attn_index)
        else:
            self.conv = ShortConv(h, config.conv_L_cache, state_index, bias=config.conv_bias)
        if moe:
            self.feed_forward = Lfm2SparseMoe(config)
        else:
            self.feed_forward = Lfm2FeedForward(h, ff_dim(config))
        self.operator_norm = RMSNorm(h, config.norm_eps)
        self.ffn_norm = RMSNorm(h, config.norm_eps)

    def forward(self, h, ctx: ForwardContext, rotary, cos_sin, pending=None):
        """``pending``: the previous layer's feed-forward output, not yet in ``h`` (added with
        this layer's first norm). Returns ``(h, y)`` with this layer's own left pending."""
        if pending is None:
            x = self.operator_norm(h)
        else:
            h, x = self.operator_norm.add_and_norm(h, pending)
        if self.is_attention:
            x = self.self_attn(x, ctx, rotary, cos_sin)
        else:
            x = self.conv(x, ctx)
        h, x = self.ffn_norm.add_and_norm(h, x)
        return h, self.feed_forward(x)


class _Lfm2Body(nn.Module):
    def __init__(self, config: Any, kinds: list[str], moe: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        is_attn = [k != "conv" for k in kinds]
        # LFM2-MoE: the feed-forwards past the first num_dense_layers are sparse
        dense = getattr(config, "num_dense_layers", len(kinds)) if moe else len(kinds)
        idx = pool_layer_indices(is_attn, [not x for x in is_attn])
        self.layers = nn.ModuleList(
            Lfm2Layer(config, att, a, s, i >= dense)
            for i, (att, (a, s)) in enumerate(zip(is_attn, idx))
        )
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)


@register_model("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
class Lfm2ForCausalLM(HybridCausalLM):
    """LFM2 and LFM2-MoE (``num_experts`` in the config). Contract: ``models/base.py`` (short
    conv has no temporal state)."""

    def __init__(self, config: Any, ssm_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_common(config, ssm_dtype)  # ssm_dtype unused: no temporal state
        kinds = list(config.layer_types)
        self.moe = getattr(config, "model_type", "") == "lfm2_moe"
        self.model = _Lfm2Body(config, kinds, self.moe)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_lm_head(getattr(config, "tie_word_embeddings", False))
        attn = [m.self_attn for m in self.model.layers if m.is_attention]
        head_dim = attn[0].head_dim if attn else 1
        convs = [m.conv for m in self.model.layers if not m.is_attention]
        self._init_memory(len(attn), config.num_key_value_heads, head_dim, convs)
        self.rotary = RotaryEmbedding(config, head_dim) if attn else None

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.embedding_norm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def num_experts(prefix: str) -> int:
            return self.get_submodule(prefix).gate_up_proj.shape[0]

        named = merge_weights(self.without_tied_head(weights), FF_MERGE)
        if self.moe:
            named = stack_expert_weights(named, num_experts, W123_EXPERTS)
        assign_weights(self, named)

    def body(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos_sin = self.rotary(ctx.layout.positions) if self.rotary is not None else None
        pending = None
        for layer in self.model.layers:
            h, pending = layer(h, ctx, self.rotary, cos_sin, pending)
        return h + pending
