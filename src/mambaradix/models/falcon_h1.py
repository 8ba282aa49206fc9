"""Falcon-H1: every layer runs attention and a Mamba2 mixer side by side on the same normed
input and adds both to the residual (``h + attn(x) + mamba(x)``), then a SwiGLU feed-forward;
RoPE attention, Mamba2 without the output norm by default (``y * silu(z)``), and muP
multipliers throughout.

Both mixers read the same input and their outputs are summed, so each layer runs them with two
linears where the checkpoint has six: ``in_proj`` is the mixer's input projection and
``q/k/v_proj`` stacked (one weight read, one call; ``[z | xBC | dt | q | k | v]``), and
``out_proj`` is the mixer's ``out_proj`` and ``o_proj`` side by side over the joined outputs
(``[W_mamba | W_o] @ [y_mamba ; y_attn]`` is the sum; the biases add). In a batch-1 decode of
Falcon-H1-0.5B, 108 calls of 1-7 MB each fewer.

The multipliers that scale a linear's input or output are folded into its weight (and bias)
as the checkpoint streams in: ``attention_in_multiplier`` into the ``q/k/v`` rows,
``key_multiplier`` into the ``k`` rows, ``attention_out_multiplier`` into the ``o`` columns,
``ssm_in_multiplier`` and the per-row ``ssm_multipliers`` (the muP vector over ``[z | x | B |
C | dt]``) into the mixer's rows, ``ssm_out_multiplier`` into its columns of ``out_proj``,
``mlp_multipliers`` into ``gate_proj`` and ``down_proj``. ``embedding_multiplier`` and
``lm_head_multiplier`` stay scalars of the model (``HybridCausalLM``'s ``embedding_multiplier``
/ ``logits_scaling``), so a tied embedding is right too. The result equals transformers' in
fp32 up to the rounding of the products; in bf16 a folded weight is rounded once where
transformers rounds the scaled activations.

Other parameter names are the checkpoint's (``mamba.*``, ``feed_forward.*``,
``input_layernorm``, ``pre_ff_layernorm``, ``final_layernorm``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
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
from mambaradix.models.weights import Concat, Lazy, Mapped, materialised

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
        projections=False,  # the layer's fused in_proj / out_proj
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
            projections=False,
        )
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        self.in_split = [self.mamba.in_width, q, kv, kv]
        in_bias = config.mamba_proj_bias or config.attention_bias
        self.in_proj = Linear(h, sum(self.in_split), bias=in_bias)
        out_bias = config.projectors_bias or config.attention_bias
        self.out_proj = Linear(self.mamba.intermediate + q, h, bias=out_bias)
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
        m, q, k, v = self.in_proj(x).split(self.in_split, dim=-1)
        y = torch.cat(
            [self.mamba.mix(m, ctx), self.self_attn.attend(q, k, v, ctx, rotary, cos_sin)], dim=-1
        )
        h, x = self.pre_ff_layernorm.add_and_norm(h, self.out_proj(y))
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
        assign_weights(self, merge_weights(self._fused(self.without_tied_head(weights)), MERGES))

    def _fused(self, weights: Iterable[tuple[str, torch.Tensor | Lazy]]) -> Iterator:
        """The checkpoint's tensors under the fused layers' names, each scaled by its muP
        multiplier: the input parts renamed for ``MERGES``, the two output projections joined
        column-wise (their biases summed), the feed-forward's scaled in place."""
        c = self.config
        mixer = self.model.layers[0].mamba
        a_in, key = float(c.attention_in_multiplier), float(c.key_multiplier)
        ssm_in, ssm_out = float(c.ssm_in_multiplier), float(c.ssm_out_multiplier)
        attn_out = float(c.attention_out_multiplier)
        gate_mult, down_mult = (float(m) for m in c.mlp_multipliers or (1.0, 1.0))
        rows = mup_rows(mixer, c.ssm_multipliers)
        # part -> (fused part's name, weight scale, bias scale): a linear(x * s_in) * s_out has
        # its weight scaled by s_in * s_out and its bias by s_out
        inputs = {
            "mamba.in_proj": ("in_mamba", rows * ssm_in, rows),
            "self_attn.q_proj": ("in_q", a_in, 1.0),
            "self_attn.k_proj": ("in_k", a_in * key, key),
            "self_attn.v_proj": ("in_v", a_in, 1.0),
            "feed_forward.gate_proj": ("feed_forward.gate_proj", gate_mult, gate_mult),
            "feed_forward.down_proj": ("feed_forward.down_proj", down_mult, down_mult),
        }
        outputs = {"mamba.out_proj": ssm_out, "self_attn.o_proj": attn_out}
        held: dict[tuple[str, str], dict[str, torch.Tensor | Lazy]] = {}
        for name, t in weights:
            layer, _, rest = name.partition(".layers.")
            index, _, part = rest.partition(".")
            module, _, leaf = part.rpartition(".")
            prefix = f"{layer}.layers.{index}"
            if not rest or leaf not in ("weight", "bias"):
                yield name, t
            elif module in inputs:
                fused, w_scale, b_scale = inputs[module]
                scale = w_scale if leaf == "weight" else b_scale
                yield f"{prefix}.{fused}.{leaf}", _scaled(t, scale)
            elif module in outputs:
                parts = held.setdefault((prefix, leaf), {})
                parts[module] = _scaled(t, outputs[module])
                if leaf == "bias":  # the biases add; one may be absent (its config flag off)
                    continue
                if len(parts) == len(outputs):
                    del held[(prefix, leaf)]
                    joined = Concat([parts["mamba.out_proj"], parts["self_attn.o_proj"]], dim=1)
                    yield f"{prefix}.out_proj.weight", joined
            else:
                yield name, t
        for (prefix, leaf), parts in held.items():
            if leaf == "bias":
                yield f"{prefix}.out_proj.bias", _summed(list(parts.values()))
            else:  # a layer short of one output weight: named as it came, left to the checks
                for module, t in parts.items():
                    yield f"{prefix}.{module}.{leaf}", t
        yield from self._zero_biases()

    def _zero_biases(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Zero biases for the input parts without one, where the others have one (the
        attention's and the mixer's bias flags differ): a fused bias has every row."""
        c = self.config
        if bool(c.attention_bias) == bool(c.mamba_proj_bias):
            return
        for i, layer in enumerate(self.model.layers):
            dtype = layer.in_proj.bias.dtype
            names = ("in_mamba",) if c.attention_bias else ("in_q", "in_k", "in_v")
            for name in names:
                n = layer.in_split[("in_mamba", "in_q", "in_k", "in_v").index(name)]
                yield f"model.layers.{i}.{name}.bias", torch.zeros(n, dtype=dtype)

    def body(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos_sin = self.rotary(ctx.layout.positions)
        pending = None
        for layer in self.model.layers:
            h, pending = layer(h, ctx, self.rotary, cos_sin, pending)
        return h + pending


MERGES = {**GATE_UP_MERGE, "in_proj": ("in_mamba", "in_q", "in_k", "in_v")}


def _scaled(t: torch.Tensor | Lazy, scale: float | torch.Tensor) -> torch.Tensor | Lazy:
    """``t`` times ``scale`` (a number, or one per row), computed in fp32 and rounded once."""
    if isinstance(scale, float) and scale == 1.0:
        return t

    def apply(w: torch.Tensor) -> torch.Tensor:
        s = scale if isinstance(scale, float) else scale.view(-1, *[1] * (w.dim() - 1))
        return (w.float() * s).to(w.dtype)

    return Mapped(t, apply)


def _summed(parts: list[torch.Tensor | Lazy]) -> torch.Tensor:
    """The sum of biases (each already scaled and rounded), in fp32, rounded once more."""
    tensors = [materialised(p) for p in parts]
    return sum(t.float() for t in tensors).to(tensors[0].dtype)
