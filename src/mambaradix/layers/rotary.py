"""Rotary position embedding, full or partial, from either config layout.

Configs give RoPE as a ``rope_parameters`` block (``rope_theta``, ``rope_type``,
``partial_rotary_factor``, scaling fields: transformers >= 5) or as top-level ``rope_theta`` /
``partial_rotary_factor`` / ``rope_scaling`` (older checkpoints). ``rope_config`` reads both.
Only the first ``rotary_dim`` features of a head rotate; the rest pass through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mambaradix.kernels.rope import apply_rope


def rope_config(config: Any) -> dict[str, Any]:
    """Normalized RoPE parameters: a dict with at least ``rope_theta``, ``rope_type`` and
    ``partial_rotary_factor`` (plus any scaling fields of the checkpoint)."""
    params: dict[str, Any] = {}
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params.update(scaling)
    block = getattr(config, "rope_parameters", None)
    if isinstance(block, dict):
        params.update(block)
    if "rope_theta" not in params:
        theta = getattr(config, "rope_theta", None)
        params["rope_theta"] = float(theta) if theta is not None else 10000.0
    if "partial_rotary_factor" not in params:
        prf = getattr(config, "partial_rotary_factor", None)
        params["partial_rotary_factor"] = float(prf) if prf is not None else 1.0
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


class RotaryEmbedding(nn.Module):
    """``forward(positions [T]) -> (cos, sin)`` each ``[T, rotary_dim]``; ``apply`` rotates.

    ``interleaved`` False is the rotate-half (GPT-NeoX) layout used by Qwen/Llama/Granite.
    Non-default rope types get their inverse frequencies from transformers' rope init functions.
    """

    def __init__(self, config: Any, head_dim: int, interleaved: bool = False) -> None:
        super().__init__()
        params = rope_config(config)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * params["partial_rotary_factor"])
        self.interleaved = interleaved
        self.attention_scaling = 1.0
        # On the CPU explicitly: a model is built under loader.no_init, where tensors default to
        # the meta device, and these frequencies are computed, not loaded.
        with torch.device("cpu"):
            if params["rope_type"] == "default":
                base = params["rope_theta"]
                exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
                inv_freq = 1.0 / (base**exps)
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                init_fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
                inv_freq, self.attention_scaling = init_fn(config, "cpu")
        # A plain attribute, not a buffer: model.to(dtype) must not round the frequencies.
        self.inv_freq = inv_freq.float()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, H, head_dim]`` with ``cos``/``sin`` ``[T, rotary_dim]``."""
        return apply_rope(x, cos, sin, self.interleaved)
