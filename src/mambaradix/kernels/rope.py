"""Rotary position embedding (torch reference kernels), alone and fused with the per-head
RMSNorm that Qwen3-Next / Qwen3.5 attention applies to q and k before it."""

from __future__ import annotations

import torch

from mambaradix.kernels.norm import rms_norm


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``rd = cos.shape[-1]`` features of every head of ``x`` ``[T, H, D]``
    with ``cos``/``sin`` ``[T, rd]``: rotate-half pairs (d, d + rd/2) (GPT-NeoX layout), or
    adjacent pairs when ``interleaved``. The other features pass through."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x_rot = x[..., :rd]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
    else:
        half = rd // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos + rotated * sin
    if rd == x.shape[-1]:
        return out
    return torch.cat([out, x[..., rd:]], dim=-1)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """``rms_norm`` over each head of ``x`` ``[T, H, D]`` (``weight`` ``[D]``), then the
    rotate-half ``apply_rope`` with ``cos``/``sin`` ``[T, rd]``."""
    return apply_rope(rms_norm(x, weight, eps, zero_centered), cos, sin)
