"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers + gated full attention with q/k norm,
dense MLP or sparse MoE with a shared expert.

Layer kinds come from ``config.layer_types`` (``linear_attention`` / ``full_attention``).
Qwen3.5 differs in the Gated DeltaNet projection layout and uses (text-only, hence plain) M-RoPE;
its multimodal checkpoints (``Qwen3_5ForConditionalGeneration``) keep the text config under
``text_config`` and the weights under ``model.language_model.``; vision weights are ignored.
Built with ``mtp=True`` the model also holds its MTP draft head (``models/mtp.py``), whose
attention layers follow the model's in the KV pool; otherwise ``mtp.*`` weights are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mambaradix.layers.attention import pooled_attention
from mambaradix.layers.gated_delta_net import GDN_MERGES, GatedDeltaNet
from mambaradix.layers.mlp import GATE_UP_MERGE, GatedMLP
from mambaradix.layers.moe import SparseMoeBlock
from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import KernelUser, Linear
from mambaradix.layers.rotary import RotaryEmbedding
from mambaradix.layout import ForwardContext
from mambaradix.models.base import HybridCausalLM
from mambaradix.models.loader import assign_weights, merge_weights
from mambaradix.models.mtp import MtpHead, is_mtp_weight, mtp_num_layers, mtp_weight_name
from mambaradix.models.registry import register_model
from mambaradix.models.weights import Mapped, stack_expert_weights

logger = logging.getLogger(__name__)


ATTN_MERGE = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}


class GatedAttention(KernelUser, nn.Module):
    """Full attention whose output is gated by ``sigmoid(gate)``; ``q_proj`` yields, per head,
    the query and the gate (``[H, 2*Dh]``). q/k get a zero-centred RMSNorm over the head dim,
    then rotate-half RoPE with the model's ``(cos, sin)``, in one op (``rms_norm_rope``)."""

    def __init__(self, cfg: Any, attn_layer: int) -> None:
        super().__init__()
        self.h, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.h
        bias = getattr(cfg, "attention_bias", False)
        # q_proj (query + gate per head), k_proj and v_proj stacked: one GEMM (ATTN_MERGE).
        self.qkv_proj = Linear(cfg.hidden_size, (2 * self.h + 2 * self.hkv) * self.d, bias=bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, zero_centered=True)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, zero_centered=True)
        self.attn_layer = attn_layer
        self.scale = self.d**-0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin) -> torch.Tensor:
        T = x.shape[0]
        hq, hk = 2 * self.h * self.d, self.hkv * self.d
        qg, k, v = self.qkv_proj(x).split([hq, hk, hk], dim=-1)
        qg = qg.reshape(T, self.h, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d :]
        k = k.reshape(T, self.hkv, self.d)
        v = v.reshape(T, self.hkv, self.d)
        cos, sin = cos_sin
        norm_rope = self.ops.rms_norm_rope
        qn, kn = self.q_norm, self.k_norm
        q = norm_rope(q, qn.weight, qn.eps, qn.zero_centered, cos, sin)
        k = norm_rope(k, kn.weight, kn.eps, kn.zero_centered, cos, sin)
        o = pooled_attention(self.ops, ctx, self.attn_layer, q, k, v, self.scale)
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(T, self.h * self.d))


class DecoderLayer(nn.Module):
    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden: int, eps: float) -> None:
        super().__init__()
        self.mixer_kind = "attn" if isinstance(mixer, GatedAttention) else "gdn"
        if self.mixer_kind == "attn":
            self.self_attn = mixer
        else:
            self.linear_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cos_sin, pending=None):
        """``pending``: the previous layer's MLP output, not yet in ``x`` (added with this
        layer's first norm). Returns ``(x, y)`` with this layer's own left pending."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(x, pending)
        if self.mixer_kind == "attn":
            h = self.self_attn(h, ctx, cos_sin)
        else:
            h = self.linear_attn(h, ctx)
        x, h = self.post_attention_layernorm.add_and_norm(x, h)
        return x, self.mlp(h)


class Qwen3NextForCausalLM(HybridCausalLM):
    """Runtime model for Qwen3-Next / Qwen3.5 checkpoints (contract: ``models/base.py``)."""

    gdn_layout = "qwen3_next"
    supports_mtp = True

    def __init__(
        self, config: Any, ssm_dtype: torch.dtype = torch.float32, mtp: bool = False
    ) -> None:
        super().__init__()
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._init_common(cfg, ssm_dtype)
        self.config = config  # the full config (multimodal for Qwen3.5); text part below
        self.text_config = cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.head_dim = head_dim
        self.rotary = RotaryEmbedding(cfg, head_dim)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, n_attn, n_state = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                mixer: nn.Module = GatedAttention(cfg, n_attn)
                n_attn += 1
            elif kind == "linear_attention":
                mixer = GatedDeltaNet(
                    cfg.hidden_size,
                    cfg.linear_num_key_heads,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                    cfg.linear_conv_kernel_dim,
                    state_layer=n_state,
                    eps=cfg.rms_norm_eps,
                    layout=self.gdn_layout,
                    activation=cfg.hidden_act,
                )
                n_state += 1
            else:
                raise ValueError(f"unsupported layer type {kind!r} at layer {i}")
            layers.append(DecoderLayer(mixer, self._make_mlp(cfg, i), cfg.hidden_size,
                                       cfg.rms_norm_eps))  # fmt: skip
        self.layers = nn.ModuleList(layers)
        self.num_attn_layers = n_attn
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_lm_head(
            getattr(cfg, "tie_word_embeddings", False)
            or getattr(config, "tie_word_embeddings", False)
        )
        n_mtp = 0
        if mtp:  # MTP layer j: a full-attention layer, the MLP kind of model layer j
            n_mtp = mtp_num_layers(cfg)
            layers = [
                DecoderLayer(GatedAttention(cfg, n_attn + j), self._make_mlp(cfg, j),
                             cfg.hidden_size, cfg.rms_norm_eps)
                for j in range(n_mtp)
            ]  # fmt: skip
            self.mtp = MtpHead(cfg, layers, self.rotary, state_layer=n_state)
        state_layers = [layer.linear_attn for layer in self.layers if layer.mixer_kind == "gdn"]
        if self.mtp is not None:
            state_layers.append(self.mtp)  # its state: the last hidden state
        self._init_memory(n_attn + n_mtp, cfg.num_key_value_heads, head_dim, state_layers)

    def _make_mlp(self, cfg: Any, i: int) -> nn.Module:
        num_experts = getattr(cfg, "num_experts", 0) or 0
        sparse_step = getattr(cfg, "decoder_sparse_step", 1) or 1
        mlp_only = getattr(cfg, "mlp_only_layers", None) or []
        if num_experts > 0 and i not in mlp_only and (i + 1) % sparse_step == 0:
            return SparseMoeBlock(
                cfg.hidden_size,
                num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                normalize=getattr(cfg, "norm_topk_prob", True),
                act=cfg.hidden_act,
            )
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    # ------------------------------------------------------------------ forward

    @property
    def embedding(self) -> nn.Embedding:
        return self.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.norm

    def body(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cos_sin = self.rotary(ctx.layout.positions) if self.num_attn_layers else None
        pending = None
        for layer in self.layers:
            x, pending = layer(x, ctx, cos_sin, pending)
        return x + pending

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Map HF names (``model.`` or ``model.language_model.`` prefixes; vision weights
        dropped, ``mtp.*`` too unless the model has its MTP head; per-expert tensors stacked)
        onto this module and copy them in."""

        def renamed():
            for name, t in weights:
                if is_mtp_weight(name):
                    if self.mtp is not None:
                        yield mtp_weight_name(name), t
                    continue
                if name.startswith(("model.visual.", "visual.")):
                    continue
                for prefix in ("model.language_model.", "language_model.model.", "model."):
                    if name.startswith(prefix):
                        name = name[len(prefix) :]
                        break
                if name.startswith("language_model.lm_head."):
                    name = name[len("language_model.") :]
                yield name, t

        def regrouped(weights):  # GDN in_proj rows in the order the layer reads them
            for name, t in weights:
                if name.endswith(".linear_attn.in_proj.weight"):
                    layer = self.get_submodule(name[: -len(".in_proj.weight")])
                    if layer.layout != "qwen3_5":  # qwen3_5 rows already are in that order
                        t = Mapped(t, layer.regroup_in_proj)
                yield name, t

        def num_experts(prefix: str) -> int:
            return self.get_submodule(prefix).gate_up_proj.shape[0]

        merges = {**GATE_UP_MERGE, **GDN_MERGES[self.gdn_layout], **ATTN_MERGE}
        stacked = stack_expert_weights(self.without_tied_head(renamed()), num_experts)
        assign_weights(self, regrouped(merge_weights(stacked, merges)))


@register_model("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    gdn_layout = "qwen3_5"


@register_model("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: Qwen3.5 Gated DeltaNet layout, a sparse MoE block in every layer."""

    gdn_layout = "qwen3_5"

    def _make_mlp(self, cfg: Any, i: int) -> nn.Module:
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
            normalize=True,
            act=cfg.hidden_act,
        )


register_model("Qwen3NextForCausalLM")(Qwen3NextForCausalLM)
