"""The published text-model configurations (data for ``models/published.py``).

Values are the published ones as found in the sources named beside each entry (model cards,
the checkpoints' ``config.json`` as quoted by transformers' docs and tests, SGLang / vLLM /
Megatron scripts); fields left out take transformers' defaults, which match the published
files for them. Only text-model fields: the Qwen3.5 checkpoints are multimodal and their
``text_config`` is what is written here.
"""

from __future__ import annotations

from mambaradix.models.published import Published


def _every(n: int, layers: int, attn: str, other: str, offset: int = 0) -> list[str]:
    """A pattern with ``attn`` at every ``n``-th layer (index ``offset`` mod ``n``)."""
    return [attn if i % n == (n - 1 + offset) % n else other for i in range(layers)]


PUBLISHED: dict[str, Published] = {}

# ----------------------------------------------------------------------------- Qwen3.5

PUBLISHED["qwen3_5_0_8b"] = Published(
    "Qwen3_5TextConfig",
    "Qwen3_5ForCausalLM",
    dict(
        vocab_size=248320, hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=_every(4, 24, "full_attention", "linear_attention"),
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000,
                             partial_rotary_factor=0.25),
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=262144,
    ),
    "Qwen/Qwen3.5-0.8B config.json text_config",
)  # fmt: skip
