"""The tiny-config builders of each architecture (``models.tiny``): ``builder(size,
**overrides) -> (hf_config, hf_model_class)``, transformers' configuration and class, with the
dimensions of ``tiny.size_dims``. Kept apart from the model files, which only run checkpoints."""

from __future__ import annotations

import re
from typing import Any

from mambaradix.models.nemotron_h import _PATTERN
from mambaradix.models.tiny import register_tiny, size_dims

# --------------------------------------------------------------------------- qwen3_next


def _gdn_dims(size: str, moe: bool) -> dict[str, Any]:
    """Config fields shared by the Qwen3-Next / Qwen3.5 tiny builders."""
    d = size_dims(size)
    kw: dict[str, Any] = dict(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=d["head_dim"],
        linear_value_head_dim=d["head_dim"],
        linear_num_key_heads=d["kv_heads"],
        linear_num_value_heads=d["heads"],
        max_position_embeddings=4096,
        initializer_range=0.05,
        full_attention_interval=2 if size == "tiny" else 4,
    )
    if moe:
        kw.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=d["intermediate"] // 4,
            shared_expert_intermediate_size=d["intermediate"] // 4,
        )
    return kw


def _tiny_qwen3_next(size: str = "tiny", moe: bool = True, **overrides: Any):
    from transformers import Qwen3NextConfig
    from transformers import Qwen3NextForCausalLM as HFModel

    kw = _gdn_dims(size, moe)
    kw.update(num_experts=kw.get("num_experts", 0), decoder_sparse_step=1)
    kw.update(overrides)
    return Qwen3NextConfig(**kw), HFModel


def _tiny_qwen3_5(size: str = "tiny", **overrides: Any):
    from transformers import Qwen3_5ForCausalLM as HFModel
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**_gdn_dims(size, moe=False), **overrides}), HFModel


def _tiny_qwen3_5_moe(size: str = "tiny", **overrides: Any):
    from transformers import Qwen3_5MoeForCausalLM as HFModel
    from transformers import Qwen3_5MoeTextConfig

    kw = _gdn_dims(size, moe=True)
    del kw["intermediate_size"]  # every layer is sparse
    return Qwen3_5MoeTextConfig(**{**kw, **overrides}), HFModel


_LAYER_NAME = re.compile(r"^(?:model\.(?:language_model\.)?)?layers\.(\d+)\.(.+)$")


def _qwen_mtp(config: Any, tensors: dict, gen: Any) -> tuple[dict, dict]:
    """The published MTP head of Qwen3-Next / Qwen3.5 (``models/mtp.py``): ``mtp.fc`` ``[H,
    2H]``, ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` ``[H]``
    and ``mtp.layers.0.*`` named and shaped as the model's first full-attention layer, with the
    MLP of model layer 0 (the MLP kind its index gives). Seeded random: linears at the
    config's initializer range, norm offsets at 0.2 (not the zeros of an untrained model, so a
    norm left out changes the result)."""
    import torch

    cfg = config.get_text_config()
    attn = list(cfg.layer_types).index("full_attention")
    hidden = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
    }
    for name, t in tensors.items():
        m = _LAYER_NAME.match(name)
        if m is None:
            continue
        i, rest = int(m.group(1)), m.group(2)
        if i == (0 if rest.startswith("mlp.") else attn):
            shapes[f"mtp.layers.0.{rest}"] = tuple(t.shape)
    dtype = next(iter(tensors.values())).dtype
    out = {}
    for name in sorted(shapes):
        scale = 0.2 if len(shapes[name]) == 1 else cfg.initializer_range
        out[name] = (torch.randn(shapes[name], generator=gen) * scale).to(dtype)
    return out, {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}


register_tiny("qwen3_next", _tiny_qwen3_next, mtp=_qwen_mtp)
register_tiny("qwen3_5_moe", _tiny_qwen3_5_moe, mtp=_qwen_mtp)
register_tiny("qwen3_5", _tiny_qwen3_5, mtp=_qwen_mtp)


# --------------------------------------------------------------------------- granite_hybrid

_MAMBA_DIMS = {  # size -> (mamba heads, head dim, d_state, layers)
    "tiny": (4, 32, 16, 5),
    "small": (8, 64, 64, 8),
    "mid": (32, 64, 128, 12),
}


def _granite_kinds(n_layers: int) -> list[str]:
    """Mostly Mamba with an attention layer at index 1 and every fourth layer after it."""
    return ["attention" if i % 4 == 1 else "mamba" for i in range(n_layers)]


def _tiny_granite(size: str = "tiny", moe: bool = False, **overrides: Any):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    d = size_dims(size)
    heads, head_dim, d_state, n_layers = _MAMBA_DIMS[size]
    kw: dict[str, Any] = dict(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        num_hidden_layers=n_layers,
        layer_types=_granite_kinds(n_layers),
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        intermediate_size=d["intermediate"] // 4,
        shared_intermediate_size=d["intermediate"],
        num_local_experts=8 if moe else 0,
        num_experts_per_tok=2,
        mamba_n_heads=heads,
        mamba_d_head=head_dim,
        mamba_d_state=d_state,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=64,
        # the dense variant uses RoPE, the MoE one no positional encoding (as Granite-4.0-H)
        position_embedding_type=None if moe else "rope",
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=(d["hidden"] // d["heads"]) ** -0.5,
        logits_scaling=2.0,
        max_position_embeddings=4096,
        initializer_range=0.1 if size == "tiny" else 0.05,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return GraniteMoeHybridConfig(**kw), GraniteMoeHybridForCausalLM


register_tiny("granite_hybrid", _tiny_granite)
register_tiny("granite_hybrid_moe", lambda size="tiny", **kw: _tiny_granite(size, moe=True, **kw))


# --------------------------------------------------------------------------- nemotron_h

_PATTERNS = {"tiny": "ME*M-M", "small": "M-M*ME-M", "mid": "M-M*ME-M*ME-"}
_DIMS = {  # size -> (mamba heads, head dim, d_state, n_groups)
    "tiny": (4, 32, 16, 2),
    "small": (8, 64, 64, 2),
    "mid": (32, 64, 128, 4),
}


def _tiny_nemotron_h(size: str = "tiny", **overrides: Any):
    from transformers import NemotronHConfig
    from transformers import NemotronHForCausalLM as HFModel

    d = size_dims(size)
    heads, head_dim, d_state, groups = _DIMS[size]
    kw: dict[str, Any] = dict(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        layers_block_type=[_PATTERN[c] for c in _PATTERNS[size]],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        intermediate_size=d["intermediate"],
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        ssm_state_size=d_state,
        n_groups=groups,
        conv_kernel=4,
        chunk_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=d["intermediate"] // 4,
        moe_shared_expert_intermediate_size=d["intermediate"] // 4,
        # transformers' chunked path clamps dt at time_step_min (its decode does not): keep the
        # floor tiny so the clamp cannot matter and transformers agrees with itself
        time_step_min=1e-4,
        time_step_max=0.5,
        max_position_embeddings=4096,
        initializer_range=0.1 if size == "tiny" else 0.05,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return NemotronHConfig(**kw), HFModel


register_tiny("nemotron_h", _tiny_nemotron_h)


# --------------------------------------------------------------------------- lfm2

_LAYERS = {"tiny": 5, "small": 8, "mid": 12}


def _lfm2_fields(size: str) -> dict[str, Any]:
    """Config fields shared by the LFM2 and LFM2-MoE tiny builders."""
    d = size_dims(size)
    n = _LAYERS[size]
    return dict(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_hidden_layers=n,
        # conv-heavy like LFM2: attention at index 2 and every third layer after it
        layer_types=["full_attention" if i % 3 == 2 else "conv" for i in range(n)],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        conv_L_cache=3,
        max_position_embeddings=4096,
        # the default 0.02 makes the conv branch too weak to show in the logits
        initializer_range=0.1 if size == "tiny" else 0.05,
    )


def _tiny_lfm2(size: str = "tiny", **overrides: Any):
    from transformers import Lfm2Config
    from transformers import Lfm2ForCausalLM as HFModel

    kw = dict(_lfm2_fields(size), block_multiple_of=32)
    kw.update(overrides)
    return Lfm2Config(**kw), HFModel


register_tiny("lfm2", _tiny_lfm2)


def _tiny_lfm2_moe(size: str = "tiny", **overrides: Any):
    from transformers import Lfm2MoeConfig
    from transformers import Lfm2MoeForCausalLM as HFModel

    kw = _lfm2_fields(size)
    kw.update(
        moe_intermediate_size=kw["intermediate_size"] // 2,
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
    )
    kw.update(overrides)
    return Lfm2MoeConfig(**kw), HFModel


def _lfm2_moe_routing(model: Any, gen: Any) -> None:
    """Router scores spread over (0, 1) and expert biases of their size (transformers starts
    the biases at zero, and its router init leaves every score near 0.5: experts tied within a
    bf16 step, so that bf16 and fp32 route apart at most tokens), so that the biases change
    which experts are chosen without making every choice a near-tie."""
    import torch

    for name, p in model.named_parameters():
        if name.endswith("feed_forward.gate.weight"):
            p.mul_(4.0)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(0.3 * torch.randn(buf.shape, generator=gen))


register_tiny("lfm2_moe", _tiny_lfm2_moe, init=_lfm2_moe_routing)


# --------------------------------------------------------------------------- falcon_h1


def _tiny_falcon_h1(size: str = "tiny", **overrides: Any):
    from transformers import FalconH1Config
    from transformers import FalconH1ForCausalLM as HFModel

    d = size_dims(size)
    kw: dict[str, Any] = dict(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_hidden_layers=d["layers"] // 2 + 1,
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        mamba_d_ssm=2 * d["hidden"],
        mamba_n_heads=2 * d["hidden"] // d["head_dim"],
        mamba_d_head=d["head_dim"],
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=64,
        mamba_rms_norm=False,
        mamba_norm_before_gate=False,
        # muP multipliers, none of them 1 so that folding each is tested; Falcon-H1-0.5B's
        # where they leave the mixer audible in a random model, larger for the mixer's own
        embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.5,  # 0.04 as published flattens the tiny logits
        key_multiplier=0.390625,
        attention_in_multiplier=0.75,
        attention_out_multiplier=0.9375,
        ssm_in_multiplier=1.25,
        ssm_out_multiplier=2.0,
        mlp_multipliers=[0.8838834764831844, 0.5859375],
        ssm_multipliers=[1.5, 2.0, 1.25, 1.5, 0.5],
        max_position_embeddings=4096,
        initializer_range=0.1 if size == "tiny" else 0.05,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return FalconH1Config(**kw), HFModel


def _falcon_h1_init(model: Any, gen: Any) -> None:
    """Time steps drawn log-uniform in [1e-3, 0.1] as Mamba2's initialiser draws them
    (transformers' Falcon-H1 starts every dt_bias at 1: a state that forgets within a few
    tokens, so a zeroed state would hardly show in the logits); the projections' biases, where
    the config asks for them, drawn too (transformers starts them at 0, where a bias loaded
    wrong would not show)."""
    import math

    import torch

    for name, p in model.named_parameters():
        if name.endswith("mamba.dt_bias"):
            u = torch.rand(p.shape, generator=gen)
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        elif name.endswith("_proj.bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


register_tiny("falcon_h1", _tiny_falcon_h1, init=_falcon_h1_init)


# --------------------------------------------------------------------------- olmo_hybrid


def _tiny_olmo_hybrid(size: str = "tiny", **overrides: Any):
    from transformers import OlmoHybridConfig
    from transformers import OlmoHybridForCausalLM as HFModel

    d = size_dims(size)
    layers = d["layers"]
    kw: dict[str, Any] = dict(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        # both kinds more than once, attention not only last
        layer_types=["linear_attention", "full_attention"] * (layers // 2),
        # key / value heads of 3/2 and 3 times the attention's (Olmo-Hybrid-7B: 96 and 192
        # against 128), and more value heads than key heads
        linear_num_key_heads=d["kv_heads"],
        linear_num_value_heads=d["heads"],
        linear_key_head_dim=3 * d["head_dim"] // 2,
        linear_value_head_dim=3 * d["head_dim"],
        linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True,
        max_position_embeddings=4096,
        initializer_range=0.05,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return OlmoHybridConfig(**kw), HFModel


def _olmo_hybrid_init(model: Any, gen: Any) -> None:
    """Norm weights drawn around 1 (transformers starts them at 1, where a norm applied in the
    wrong place, or one left out of a fused op, would not show)."""
    import torch

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))


register_tiny("olmo_hybrid", _tiny_olmo_hybrid, init=_olmo_hybrid_init)
