"""Falcon-H1: every layer runs attention and a Mamba2 mixer side by side on the same normed
input and adds both to the residual (``h + attn(x) + mamba(x)``), then a SwiGLU feed-forward;
RoPE attention, Mamba2 without the output norm by default (``y * silu(z)``), and muP
multipliers throughout.

The multipliers that scale a linear's input or output are folded into its weight (and bias)
once the checkpoint is loaded: ``attention_in_multiplier`` into ``q/k/v_proj``,
``key_multiplier`` into ``k_proj``, ``attention_out_multiplier`` into ``o_proj``,
``ssm_in_multiplier`` and the per-row ``ssm_multipliers`` (the muP vector over
``[z | x | B | C | dt]``) into the mixer's ``in_proj``, ``ssm_out_multiplier`` into its
``out_proj``, ``mlp_multipliers`` into the gate rows of ``gate_up_proj`` and into
``down_proj``. ``embedding_multiplier`` and ``lm_head_multiplier`` stay scalars of the model
(``HybridCausalLM``'s ``embedding_multiplier`` / ``logits_scaling``), so a tied embedding is
right too. The result equals transformers' in fp32 up to the rounding of the products; in bf16
a folded weight is rounded once where transformers rounds the scaled activations.

Parameter names are the checkpoint's (``mamba.*``, ``self_attn.*``, ``feed_forward.*``,
``input_layernorm``, ``pre_ff_layernorm``, ``final_layernorm``), so weights load by name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mambaradix.layers.mamba2 import Mamba2Mixer
from mambaradix.layers.mlp import GATE_UP_MERGE, GatedMLP
from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import Linear
from mambaradix.layers.rotary import RotaryEmbedding
from mambaradix.layout import ForwardContext
from mambaradix.models.base import HybridCausalLM, pool_layer_indices
from mambaradix.models.granite_hybrid import ProjAttention
from mambaradix.models.loader import assign_weights, merge_weights
from mambaradix.models.registry import register_model

logger = logging.getLogger(__name__)


def _mixer(config: Any, state_index: int) -> Mamba2Mixer:
    h = config.hidden_size
    d_ssm = config.mamba_d_ssm or int(config.mamba_expand * h)
    heads = config.mamba_n_heads
    return Mamba2Mixer(
        h,
        heads,
        d_ssm // heads,
        config.mamba_n_groups,
        config.mamba_d_state,
        config.mamba_d_conv,
        state_index,
        conv_bias=config.mamba_conv_bias,
        proj_bias=config.mamba_proj_bias,
        out_bias=config.projectors_bias,
        norm_eps=config.rms_norm_eps,
        dt_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
        activation=config.hidden_act,
        gated_norm=config.mamba_rms_norm,
        norm_before_gate=config.mamba_norm_before_gate,
    )


class FalconH1Layer(nn.Module):
    def __init__(self, config: Any, attn_index: int, state_index: int) -> None:
        super().__init__()
        h = config.hidden_size
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.mamba = _mixer(config, state_index)
        self.self_attn = ProjAttention(
            h,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            attn_index,
            head_dim**-0.5,
            bias=config.attention_bias,
        )
        self.feed_forward = GatedMLP(h, config.intermediate_size, config.hidden_act,
                                     bias=config.mlp_bias)  # fmt: skip
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, h, ctx: ForwardContext, rotary, cos_sin, pending=None):
        """``pending``: the previous layer's feed-forward output, not yet in ``h``. Returns
        ``(h, y)`` with this layer's own left pending."""
        if pending is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add_and_norm(h, pending)
        both = self.mamba(x, ctx) + self.self_attn(x, ctx, rotary, cos_sin)
        h, x = self.pre_ff_layernorm.add_and_norm(h, both)
        return h, self.feed_forward(x)


class _Body(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        n = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            FalconH1Layer(config, a, s) for a, s in pool_layer_indices([True] * n, [True] * n)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def mup_rows(mixer: Mamba2Mixer, multipliers: list[float] | None) -> torch.Tensor:
    """The per-row multiplier of ``mixer.in_proj``'s output ``[z | x | B | C | dt]``."""
    gn = mixer.n_groups * mixer.d_state
    sizes = (mixer.intermediate, mixer.intermediate, gn, gn, mixer.num_heads)
    mults = multipliers or [1.0] * 5
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, mults)])


@register_model("FalconH1ForCausalLM")
class FalconH1ForCausalLM(HybridCausalLM):
    """Falcon-H1. Contract: ``models/base.py``; every layer is in both pools."""

    def __init__(self, config: Any, ssm_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_common(config, ssm_dtype)
        self.model = _Body(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_lm_head(getattr(config, "tie_word_embeddings", False))
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = 1.0 / float(config.lm_head_multiplier)
        attn = [layer.self_attn for layer in self.model.layers]
        mambas = [layer.mamba for layer in self.model.layers]
        self._init_memory(len(attn), config.num_key_value_heads, attn[0].head_dim, mambas)
        self.rotary = RotaryEmbedding(config, attn[0].head_dim)

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.model.final_layernorm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        assign_weights(self, merge_weights(self.without_tied_head(weights), GATE_UP_MERGE))
        self._fold_multipliers()

    @torch.no_grad()
    def _fold_multipliers(self) -> None:
        c = self.config
        gate_mult, down_mult = c.mlp_multipliers or (1.0, 1.0)
        rows = mup_rows(self.model.layers[0].mamba, c.ssm_multipliers) * float(c.ssm_in_multiplier)
        for layer in self.model.layers:
            att, mix, ff = layer.self_attn, layer.mamba, layer.feed_forward
            a_in = float(c.attention_in_multiplier)
            _scale(att.q_proj, a_in, inputs_only=True)
            _scale(att.v_proj, a_in, inputs_only=True)
            _scale(att.k_proj, a_in, inputs_only=True)
            _scale(att.k_proj, float(c.key_multiplier))
            _scale(att.o_proj, float(c.attention_out_multiplier))
            _scale_rows(mix.in_proj, rows, input_scale=float(c.ssm_in_multiplier))
            _scale(mix.out_proj, float(c.ssm_out_multiplier))
            gate_rows = torch.ones(ff.gate_up_proj.weight.shape[0])
            gate_rows[: ff.intermediate] = float(gate_mult)
            _scale_rows(ff.gate_up_proj, gate_rows)
            _scale(ff.down_proj, float(down_mult))

    def body(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos_sin = self.rotary(ctx.layout.positions)
        pending = None
        for layer in self.model.layers:
            h, pending = layer(h, ctx, self.rotary, cos_sin, pending)
        return h + pending


def _scale(linear: nn.Module, m: float, inputs_only: bool = False) -> None:
    """``linear(x) * m`` (or, ``inputs_only``, ``linear(x * m)``) as one linear."""
    if m == 1.0:
        return
    linear.weight.mul_(m)
    if linear.bias is not None and not inputs_only:
        linear.bias.mul_(m)


def _scale_rows(linear: nn.Module, rows: torch.Tensor, input_scale: float = 1.0) -> None:
    """``linear(x * input_scale) * rows`` (``rows`` per output feature, including
    ``input_scale``, which the bias does not take) as one linear."""
    w = linear.weight
    w.copy_((w.float() * rows.to(w.device)[:, None]).to(w.dtype))
    if linear.bias is not None:
        b = linear.bias
        b.copy_((b.float() * (rows / input_scale).to(b.device)).to(b.dtype))
