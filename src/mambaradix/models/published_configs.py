"""The published text-model configurations (data for ``models/published.py``).

Each entry is written from the published ``config.json`` values as found in public sources with
the ``search`` tools of this project (no download was possible); the comment above it says
where. Only text-model fields that change shapes or the code path are written; the rest take
transformers' defaults. The Qwen3.5 checkpoints are multimodal: their ``text_config`` is what
is written here (the loader's multimodal layout is tested elsewhere). Values that were not
confirmed by a source are marked "not confirmed".
"""

from __future__ import annotations

from mambaradix.models.published import Published


def _every(n: int, layers: int, attn: str, other: str) -> list[str]:
    """``attn`` at every ``n``-th layer (indices n-1, 2n-1, ...), ``other`` elsewhere."""
    return [attn if i % n == n - 1 else other for i in range(layers)]


def _at(layers: int, attn_idx: tuple[int, ...], attn: str, other: str) -> list[str]:
    return [attn if i in attn_idx else other for i in range(layers)]


_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron(pattern: str) -> list[str]:
    """NemotronH's published ``hybrid_override_pattern`` as transformers' ``layers_block_type``."""
    return [_NEMOTRON_KINDS[c] for c in pattern]


_QWEN35_ROPE = dict(rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25)
_GDN = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            linear_num_key_heads=16)  # fmt: skip
GDN_LINEAR, GDN_FULL = "linear_attention", "full_attention"

PUBLISHED: dict[str, Published] = {}

# ----------------------------------------------------------------------------- Qwen3.5 dense

# Qwen/Qwen3.5-0.8B: bench/bench_real.py's preset (GDN 16 x 128 key and value heads, attention
# 8 x 256 with 2 KV heads, 3:1 GDN:attention, tied); the 3:1 layout and head dims agree with
# transformers' qwen3_5 docs. Layer count and intermediate size not confirmed by a source.
PUBLISHED["qwen3_5_0_8b"] = Published(
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    dict(
        vocab_size=248320,
        hidden_size=1024,
        num_hidden_layers=24,
        intermediate_size=3584,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=16,
        layer_types=_every(4, 24, GDN_FULL, GDN_LINEAR),
        rope_parameters=_QWEN35_ROPE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=262144,
        **_GDN,
    ),
    "Qwen/Qwen3.5-0.8B (bench_real preset; layer count and intermediate size not confirmed)",
)
# Qwen/Qwen3.5-2B: hidden 2048, 24 layers, GDN 16 x 128 value heads, attention 8 x 256 / 2 KV.
# Not confirmed by a source (model family docs only); widths as the 0.8B's family pattern.
PUBLISHED["qwen3_5_2b"] = Published(
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=24,
        intermediate_size=6144,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=16,
        layer_types=_every(4, 24, GDN_FULL, GDN_LINEAR),
        rope_parameters=_QWEN35_ROPE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=262144,
        **_GDN,
    ),
    "Qwen/Qwen3.5-2B (not confirmed)",
)
# Qwen/Qwen3.5-4B text_config as quoted verbatim by a public HF-config ingestion test
# (QWEN3_5_4B_HF: hidden 2560, 32 layers, 16 heads / 4 KV x 256, intermediate 9216, GDN
# 16 key / 32 value heads of 128, 3:1, tied).
PUBLISHED["qwen3_5_4b"] = Published(
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    dict(
        vocab_size=248320,
        hidden_size=2560,
        num_hidden_layers=32,
        intermediate_size=9216,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_value_heads=32,
        layer_types=_every(4, 32, GDN_FULL, GDN_LINEAR),
        rope_parameters=_QWEN35_ROPE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        max_position_embeddings=262144,
        **_GDN,
    ),
    "Qwen/Qwen3.5-4B config.json (quoted by an ingestion test's fixture)",
)
# Qwen/Qwen3.5-9B: 32 layers, hidden 4096, FFN 12288, 16 heads / 4 KV, GDN 16 key groups and
# 32 value heads (model pages reading the published metadata: fitmygpu.com, a GGUF review);
# head_dim 256 and vocab 248320 (aprender's Qwen3.5-9B notes). tie: not confirmed (False).
PUBLISHED["qwen3_5_9b"] = Published(
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    dict(
        vocab_size=248320,
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=12288,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_value_heads=32,
        layer_types=_every(4, 32, GDN_FULL, GDN_LINEAR),
        rope_parameters=_QWEN35_ROPE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        **_GDN,
    ),
    "Qwen/Qwen3.5-9B (model pages quoting the published metadata)",
)

# ----------------------------------------------------------------------------- MoE GDN

# Qwen/Qwen3.5-35B-A3B text_config as quoted in full by a public Go test fixture
# (qwen35_35B_A3B) and a Python one: hidden 2048, 40 layers, 256 experts top-8 of 512, shared
# expert 512, 16 heads / 2 KV x 256, GDN 16 / 32 heads of 128, untied.
PUBLISHED["qwen3_5_35b_a3b"] = Published(
    "Qwen3_5MoeTextConfig",
    "Qwen3_5MoeForCausalLM",
    dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        layer_types=_every(4, 40, GDN_FULL, GDN_LINEAR),
        rope_parameters=_QWEN35_ROPE,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        **_GDN,
    ),
    "Qwen/Qwen3.5-35B-A3B config.json text_config (quoted by test fixtures)",
)
# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (quoted by a public model-config page and an
# APR design doc): hidden 2048, 48 layers, 512 experts top-10 of 512, shared 512, dense
# intermediate 5120, 16 heads / 2 KV x 256, GDN 16 / 32 heads of 128, vocab 151936. The two
# sources disagree on rope_theta (5e6 / 1e7); it changes no shape.
PUBLISHED["qwen3_next_80b_a3b"] = Published(
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    dict(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        intermediate_size=5120,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_value_heads=32,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        layer_types=_every(4, 48, GDN_FULL, GDN_LINEAR),
        rope_parameters=dict(
            rope_type="default", rope_theta=10_000_000, partial_rotary_factor=0.25
        ),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        **_GDN,
    ),
    "Qwen/Qwen3-Next-80B-A3B-Instruct config.json (quoted)",
)

# ----------------------------------------------------------------------------- LFM2

_LFM2_ATTN_16 = (2, 5, 8, 10, 12, 14)  # LFM2-350M / 1.2B: 10 conv + 6 attention blocks
# LiquidAI/LFM2-350M: bench_real's preset (block_ff_dim 6656 auto-adjusted to 4608, as the
# LFM2.5-350M config quoted in llama.cpp issue 22287 lists); 16 heads / 8 KV; transformers'
# LFM2 docs: 16 blocks, 10 conv + 6 attention.
PUBLISHED["lfm2_350m"] = Published(
    "Lfm2Config",
    "Lfm2ForCausalLM",
    dict(
        vocab_size=65536,
        hidden_size=1024,
        num_hidden_layers=16,
        intermediate_size=6656,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        num_attention_heads=16,
        num_key_value_heads=8,
        conv_L_cache=3,
        layer_types=_at(16, _LFM2_ATTN_16, "full_attention", "conv"),
        tie_word_embeddings=True,
        max_position_embeddings=128000,
    ),
    "LiquidAI/LFM2-350M (bench_real preset; llama.cpp #22287; transformers LFM2 docs)",
)
# LiquidAI/LFM2-1.2B: hidden 2048, 16 layers (10 conv + 6 attention), 32 heads / 8 KV x 64
# (pcpartguide / transformers docs); block_ff_dim 12288 not confirmed.
PUBLISHED["lfm2_1_2b"] = Published(
    "Lfm2Config",
    "Lfm2ForCausalLM",
    dict(
        vocab_size=65536,
        hidden_size=2048,
        num_hidden_layers=16,
        intermediate_size=12288,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        num_attention_heads=32,
        num_key_value_heads=8,
        conv_L_cache=3,
        layer_types=_at(16, _LFM2_ATTN_16, "full_attention", "conv"),
        tie_word_embeddings=True,
        max_position_embeddings=128000,
    ),
    "LiquidAI/LFM2-1.2B (model pages; block_ff_dim not confirmed)",
)
# LiquidAI/LFM2-2.6B config.json as quoted by a public HF-config ingestion test (LFM2_2P6B_HF:
# hidden 2048, 30 layers, 32 heads / 8 KV, ff 10752, conv L 3, its layer_types).
PUBLISHED["lfm2_2_6b"] = Published(
    "Lfm2Config",
    "Lfm2ForCausalLM",
    dict(
        vocab_size=65536,
        hidden_size=2048,
        num_hidden_layers=30,
        intermediate_size=10752,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        num_attention_heads=32,
        num_key_value_heads=8,
        conv_L_cache=3,
        layer_types=_at(30, (2, 5, 9, 13, 17, 21, 24, 27), "full_attention", "conv"),
        tie_word_embeddings=True,
        max_position_embeddings=128000,
    ),
    "LiquidAI/LFM2-2.6B config.json (quoted by an ingestion test's fixture)",
)

# ----------------------------------------------------------------------------- Granite-4.0-H

_GRANITE_40 = _at(40, (5, 15, 25, 35), "attention", "mamba")  # 9 Mamba2 : 1 attention
_GRANITE_MAMBA = dict(mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4,
                      mamba_expand=2, mamba_chunk_size=256)  # fmt: skip
# ibm-granite/granite-4.0-h-350m: bench_real's preset (hidden 768, 32 layers, attention at 10,
# 13, 17, 27, Granite multipliers); not confirmed by a quoted config.json.
PUBLISHED["granite_4_0_h_350m"] = Published(
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    dict(
        vocab_size=100352,
        hidden_size=768,
        num_hidden_layers=32,
        num_attention_heads=12,
        num_key_value_heads=4,
        shared_intermediate_size=2048,
        intermediate_size=2048,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=24,
        layer_types=_at(32, (10, 13, 17, 27), "attention", "mamba"),
        position_embedding_type=None,
        embedding_multiplier=12.0,
        residual_multiplier=0.246,
        attention_multiplier=0.0078125,
        logits_scaling=3.0,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        **_GRANITE_MAMBA,
    ),
    "ibm-granite/granite-4.0-h-350m (bench_real preset)",
)
# ibm-granite/granite-4.0-h-1b config.json, quoted "verbatim from the published config.json"
# by a public ingestion test (GRANITE_H_1B_HF): hidden 1536, 40 layers, dense (0 experts),
# shared MLP 4096, Mamba2 48 x 64, d_state 128, attention at 5/15/25/35. Multipliers: defaults.
PUBLISHED["granite_4_0_h_1b"] = Published(
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    dict(
        vocab_size=100352,
        hidden_size=1536,
        num_hidden_layers=40,
        num_attention_heads=12,
        num_key_value_heads=4,
        shared_intermediate_size=4096,
        intermediate_size=4096,
        num_local_experts=0,
        num_experts_per_tok=0,
        mamba_n_heads=48,
        layer_types=_GRANITE_40,
        position_embedding_type=None,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        **_GRANITE_MAMBA,
    ),
    "ibm-granite/granite-4.0-h-1b config.json (quoted by an ingestion test's fixture)",
)
# ibm-granite/granite-4.0-h-tiny (same source, GRANITE_H_TINY_HF): hidden 1536, 40 layers,
# 64 experts top-6 of 512, shared 1024, Mamba2 48 x 64.
PUBLISHED["granite_4_0_h_tiny"] = Published(
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    dict(
        vocab_size=100352,
        hidden_size=1536,
        num_hidden_layers=40,
        num_attention_heads=12,
        num_key_value_heads=4,
        shared_intermediate_size=1024,
        intermediate_size=512,
        num_local_experts=64,
        num_experts_per_tok=6,
        mamba_n_heads=48,
        layer_types=_GRANITE_40,
        position_embedding_type=None,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        **_GRANITE_MAMBA,
    ),
    "ibm-granite/granite-4.0-h-tiny config.json (quoted by an ingestion test's fixture)",
)
# ibm-granite/granite-4.0-h-small config.json (quoted in a public memory-estimator doc):
# hidden 4096, 40 layers (36 mamba + 4 attention), 32 heads / 8 KV, 72 experts top-10 of 768,
# shared 1536, d_state 128, expand 2 (so 128 Mamba2 heads of 64). Attention positions: as
# h-tiny's (not confirmed).
PUBLISHED["granite_4_0_h_small"] = Published(
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    dict(
        vocab_size=100352,
        hidden_size=4096,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        shared_intermediate_size=1536,
        intermediate_size=768,
        num_local_experts=72,
        num_experts_per_tok=10,
        mamba_n_heads=128,
        layer_types=_GRANITE_40,
        position_embedding_type=None,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        **_GRANITE_MAMBA,
    ),
    "ibm-granite/granite-4.0-h-small config.json (quoted)",
)

# ----------------------------------------------------------------------------- Nemotron-H

_NEMOTRON_MAMBA = dict(ssm_state_size=128, conv_kernel=4, n_groups=8, chunk_size=128,
                       expand=2)  # fmt: skip
# nvidia/Nemotron-H-8B-Base-8K: hidden 4096, 52 layers, 128 Mamba2 heads of 64, 8 groups,
# 32 heads / 8 KV x 128, MLP 21504, vocab 131072 (a public loader test's "real-shaped" config
# with the verbatim 8B pattern prefix "M-M-M-M*-"); the full 52-layer pattern: not confirmed.
PUBLISHED["nemotron_h_8b"] = Published(
    "NemotronHConfig",
    "NemotronHForCausalLM",
    dict(
        vocab_size=131072,
        hidden_size=4096,
        layers_block_type=_nemotron("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=21504,
        mamba_num_heads=128,
        mamba_head_dim=64,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        **_NEMOTRON_MAMBA,
    ),
    "nvidia/Nemotron-H-8B-Base-8K (quoted in part)",
)
# nvidia/NVIDIA-Nemotron-Nano-9B-v2: the NEMOTRON_H geometry quoted by public memory-estimator
# tests (hidden 4480, 56 layers and its hybrid_override_pattern, 128 Mamba2 heads of 80, 8
# groups, 40 heads / 8 KV x 128, MLP 15680, vocab 131072).
PUBLISHED["nemotron_nano_9b_v2"] = Published(
    "NemotronHConfig",
    "NemotronHForCausalLM",
    dict(
        vocab_size=131072,
        hidden_size=4480,
        layers_block_type=_nemotron("M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"),
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=15680,
        mamba_num_heads=128,
        mamba_head_dim=80,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        **_NEMOTRON_MAMBA,
    ),
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2 (quoted by test fixtures)",
)
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B config.json as quoted by public test fixtures (hidden
# 2688, 52 layers "MEMEM*E...", 64 Mamba2 heads of 64, 8 groups, 32 heads / 2 KV x 128, 128
# routed experts top-6 of 1856, shared 3712, routed scaling 2.5, relu2 MLPs).
PUBLISHED["nemotron_3_nano_30b_a3b"] = Published(
    "NemotronHConfig",
    "NemotronHForCausalLM",
    dict(
        vocab_size=131072,
        hidden_size=2688,
        layers_block_type=_nemotron("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=1856,
        mamba_num_heads=64,
        mamba_head_dim=64,
        n_routed_experts=128,
        num_experts_per_tok=6,
        moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        **_NEMOTRON_MAMBA,
    ),
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B config.json (quoted by test fixtures)",
)

# LFM2-MoE: LFM2-2.6B's width and attention (hidden 2048, 32 heads / 8 KV), the first 2
# feed-forwards dense (7168), then experts chosen top 4 by sigmoid score plus an expert bias
# (transformers' Lfm2MoeConfig defaults; LiquidAI's LFM2-24B-A2B release notes).
_LFM2_MOE = dict(
    vocab_size=65536,
    hidden_size=2048,
    intermediate_size=7168,
    num_dense_layers=2,
    num_experts_per_tok=4,
    use_expert_bias=True,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    num_attention_heads=32,
    num_key_value_heads=8,
    conv_L_cache=3,
    tie_word_embeddings=True,
    max_position_embeddings=128000,
)
# LiquidAI/LFM2-8B-A1B (8.3B total / 1.5B active): 24 layers (6 attention), 32 experts of
# 1792; the attention positions are not confirmed.
PUBLISHED["lfm2_8b_a1b"] = Published(
    "Lfm2MoeConfig",
    "Lfm2MoeForCausalLM",
    dict(
        num_hidden_layers=24,
        moe_intermediate_size=1792,
        num_experts=32,
        layer_types=_at(24, (2, 6, 10, 14, 18, 21), "full_attention", "conv"),
        **_LFM2_MOE,
    ),
    "LiquidAI/LFM2-8B-A1B (transformers' Lfm2MoeConfig; LiquidAI's LFM2-24B-A2B notes)",
)
# LiquidAI/LFM2-24B-A2B: 40 layers (10 attention, assumed one in four), 64 experts of 1536.
PUBLISHED["lfm2_24b_a2b"] = Published(
    "Lfm2MoeConfig",
    "Lfm2MoeForCausalLM",
    dict(
        num_hidden_layers=40,
        moe_intermediate_size=1536,
        num_experts=64,
        layer_types=_at(40, tuple(range(2, 40, 4)), "full_attention", "conv"),
        **_LFM2_MOE,
    ),
    "LiquidAI/LFM2-24B-A2B (LiquidAI's release notes: 40 layers, 64 experts x 1536, top 4)",
)

# ----------------------------------------------------------------------------- Falcon-H1

# tiiuae/Falcon-H1-0.5B-Instruct config.json as quoted by mlx-lm's and Megatron-Bridge's ports:
# 36 layers, each attention (8 heads / 2 KV x 64, RoPE theta 1e11) beside a Mamba2 mixer
# (24 heads x 64, d_state 128, no output norm), SwiGLU 2048, its muP multipliers.
PUBLISHED["falcon_h1_0_5b"] = Published(
    "FalconH1Config",
    "FalconH1ForCausalLM",
    dict(
        vocab_size=32784,
        hidden_size=1024,
        num_hidden_layers=36,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        mamba_d_ssm=1536,
        mamba_n_heads=24,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=128,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        mamba_rms_norm=False,
        mamba_norm_before_gate=False,
        embedding_multiplier=5.656854249492381,
        lm_head_multiplier=0.0390625,
        key_multiplier=0.390625,
        attention_in_multiplier=1.0,
        attention_out_multiplier=0.9375,
        ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.23570226039551587,
        mlp_multipliers=[0.8838834764831844, 0.5859375],
        ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        rope_parameters={"rope_type": "default", "rope_theta": 1e11},
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "tiiuae/Falcon-H1-0.5B-Instruct config.json (quoted by mlx-lm's and Megatron-Bridge's ports)",
)

# allenai/Olmo-Hybrid-7B: 32 layers, every fourth full attention (30 heads x 128, q/k normed
# across heads), the others Gated DeltaNet (30 heads, keys 96, values 192, beta doubled),
# SwiGLU 11008, vocabulary 100352.
PUBLISHED["olmo_hybrid_7b"] = Published(
    "OlmoHybridConfig",
    "OlmoHybridForCausalLM",
    dict(
        vocab_size=100352,
        hidden_size=3840,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=30,
        num_key_value_heads=30,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
        linear_num_key_heads=30,
        linear_num_value_heads=30,
        linear_key_head_dim=96,
        linear_value_head_dim=192,
        linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=65536,
        tie_word_embeddings=False,
        pad_token_id=100277,
        eos_token_id=100257,
    ),
    "allenai/Olmo-Hybrid-7B as transformers 5.24's OlmoHybridConfig defaults document it (every "
    "fourth layer attention); its config.json itself not seen (the RoPE theta unconfirmed)",
)

# Published checkpoints whose architecture transformers has but this engine does not run:
# loading one must fail with the list of supported architectures.
UNSUPPORTED = {
    "mamba_130m": ("mamba", "MambaForCausalLM"),
    "jamba_mini": ("jamba", "JambaForCausalLM"),
}
