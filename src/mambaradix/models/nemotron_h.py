"""NemotronH: a stack of single-mixer blocks (``h + mixer(norm(h))``) where each mixer is Mamba2
(with n_groups > 1), attention without positional encoding, a non-gated MLP, or a MoE with a
sigmoid group-limited router, a shared expert and optional latent projections.

Parameter names are the checkpoint's (``backbone.*``), so weights load by name; the routed
experts' per-expert tensors (``mixer.experts.{e}.up_proj.weight``) are stacked while loading
into the fused ``experts.up_proj`` ``[E, I, H]`` / ``experts.down_proj`` ``[E, H, I]`` (the
names transformers gives them in memory), which the backend's ``moe_experts`` runs as plain
(non-gated) experts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mambaradix.layers.mamba2 import Mamba2Mixer
from mambaradix.layers.mlp import activation
from mambaradix.layers.moe import Experts, KeepsFloat32
from mambaradix.layers.norm import RMSNorm
from mambaradix.layers.ops import Linear
from mambaradix.layout import ForwardContext
from mambaradix.models.base import HybridCausalLM, pool_layer_indices
from mambaradix.models.granite_hybrid import ATTENTION, MAMBA, ProjAttention, layer_kinds
from mambaradix.models.loader import assign_weights
from mambaradix.models.registry import register_model
from mambaradix.models.weights import PLAIN_EXPERTS, stack_expert_weights

logger = logging.getLogger(__name__)

MLP, MOE = "mlp", "moe"
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}


class NemotronMLP(nn.Module):
    """``down_proj(act(up_proj(x)))`` (no gate)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronRouter(KeepsFloat32):
    """Sigmoid scores; experts chosen among the ``topk_group`` best groups (a group's score is
    the sum of its two best biased scores); weights are the unbiased scores, optionally
    renormalized, times ``routed_scaling_factor``. Its weight and bias stay float32 (as in the
    reference model)."""

    fp32_params = ("weight", "e_score_correction_bias")

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(self.num_experts), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            per = self.num_experts // self.n_group
            grouped = choice.view(-1, self.n_group, per)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group_scores)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], 1.0)
            mask = keep[:, :, None].expand(-1, -1, per).reshape(-1, self.num_experts)
            choice = choice.masked_fill(mask == 0, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scaling


class NemotronMoE(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        latent = getattr(config, "moe_latent_size", None)
        inner = latent or h
        act, bias = config.mlp_hidden_act, config.mlp_bias
        self.gate = NemotronRouter(config)
        self.experts = Experts(
            config.n_routed_experts, inner, config.moe_intermediate_size, act, gated=False
        )
        self.shared_experts = NemotronMLP(h, config.moe_shared_expert_intermediate_size, act, bias)
        self.fc1_latent_proj = Linear(h, latent, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(latent, h, bias=bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)
        z = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        out = self.experts(z, w, idx)  # (fp32 weights: summed in fp32, as transformers sums)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)


class NemotronBlock(nn.Module):
    def __init__(self, config: Any, kind: str, attn_index: int, state_index: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.kind = kind
        self.norm = RMSNorm(h, config.layer_norm_epsilon)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(
                h,
                config.mamba_num_heads,
                config.mamba_head_dim,
                config.n_groups,
                config.ssm_state_size,
                config.conv_kernel,
                state_index,
                conv_bias=config.use_conv_bias,
                proj_bias=config.use_bias,
                norm_eps=config.layer_norm_epsilon,
                # transformers clamps dt at time_step_min in its chunked path but not in its
                # decode step; we follow config.time_step_limit (the original model, and
                # transformers' decode) in both, so prefill and decode agree.
                dt_limit=tuple(getattr(config, "time_step_limit", (0.0, float("inf")))),
                activation=config.mamba_hidden_act,
            )
        elif kind == ATTENTION:
            head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
            self.mixer = ProjAttention(
                h,
                config.num_attention_heads,
                config.num_key_value_heads,
                head_dim,
                attn_index,
                head_dim**-0.5,
            )
        elif kind == MLP:
            self.mixer = NemotronMLP(
                h, config.intermediate_size, config.mlp_hidden_act, config.mlp_bias
            )
        elif kind == MOE:
            self.mixer = NemotronMoE(config)
        else:
            raise ValueError(f"unknown NemotronH block type {kind!r}")

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.norm(h)
        if self.kind == MAMBA:
            x = self.mixer(x, ctx)
        elif self.kind == ATTENTION:
            x = self.mixer(x, ctx, None, None)
        else:
            x = self.mixer(x)
        return h + x


class _Backbone(nn.Module):
    def __init__(self, config: Any, kinds: list[str]) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        idx = pool_layer_indices([k == ATTENTION for k in kinds], [k == MAMBA for k in kinds])
        self.layers = nn.ModuleList(
            NemotronBlock(config, kind, a, s) for kind, (a, s) in zip(kinds, idx)
        )
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


@register_model("NemotronHForCausalLM")
class NemotronHForCausalLM(HybridCausalLM):
    """NemotronH. Contract: ``models/base.py``."""

    def __init__(self, config: Any, ssm_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self._init_common(config, ssm_dtype)
        kinds = [_PATTERN.get(k, k) for k in layer_kinds(config)]
        self.backbone = _Backbone(config, kinds)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_lm_head(getattr(config, "tie_word_embeddings", False))
        attn = [b.mixer for b in self.backbone.layers if b.kind == ATTENTION]
        mambas = [b.mixer for b in self.backbone.layers if b.kind == MAMBA]
        head_dim = attn[0].head_dim if attn else 1
        self._init_memory(len(attn), config.num_key_value_heads, head_dim, mambas)

    @property
    def embedding(self) -> nn.Embedding:
        return self.backbone.embeddings

    @property
    def final_norm(self) -> nn.Module:
        return self.backbone.norm_f

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.startswith("model."):  # transformers' in-memory prefix
                    name = "backbone." + name[len("model.") :]
                if name.startswith("mtp."):  # multi-token-prediction head: unused
                    continue
                yield name, t

        def num_experts(prefix: str) -> int:
            return self.get_submodule(prefix).up_proj.shape[0]

        named = self.without_tied_head(renamed())
        assign_weights(self, stack_expert_weights(named, num_experts, PLAIN_EXPERTS))

    def body(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        for block in self.backbone.layers:
            h = block(h, ctx)
        return h
