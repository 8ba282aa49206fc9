"""RMSNorm (torch reference kernels)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_normalize(x: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """``x / rms(x)`` in fp32 over the last dim, or over each group of ``group_size`` of it."""
    xf = x.float()
    if group_size is None or group_size == xf.shape[-1]:
        return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    shape = xf.shape
    return rms_normalize(xf.reshape(*shape[:-1], -1, group_size), eps).reshape(shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    """RMSNorm over the last dim: ``norm(x) * (1 + weight)`` in fp32 when ``zero_centered``
    (Qwen3-Next), else ``weight * norm(x)`` in x's dtype (Llama convention)."""
    y = rms_normalize(x, eps)
    if zero_centered:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual block's end and the next norm: ``h = residual + x * scale`` (in x's dtype, as
    a layer writes it) and ``rms_norm(h)``; returns ``(h, normed)``."""
    h = residual + (x * scale if scale != 1.0 else x)
    return h, rms_norm(h, weight, eps, zero_centered)


def rms_norm_gate_first(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """``weight * norm(x * silu(gate))`` with each group of ``group_size`` features normalised
    on its own (Mamba2's output norm), in x's dtype; ``gate`` has x's shape."""
    y = rms_normalize(x.float() * F.silu(gate.float()), eps, group_size)
    return weight * y.to(x.dtype)


def silu_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * silu(gate)`` in fp32, rounded once to x's dtype (a Mamba2 mixer without its output
    norm: Falcon-H1's default)."""
    return (x.float() * F.silu(gate.float())).to(x.dtype)


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``weight * norm(x) * silu(gate)`` over the last dim (Gated DeltaNet's output norm), in
    x's dtype; ``gate`` has x's shape."""
    y = weight * rms_normalize(x, eps).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


@dataclass(frozen=True, slots=True)
class GatedNorm:
    """A recurrent mixer's gated output norm, handed to its decode op to finish there (the
    backend may fold it into the same kernel): ``gate`` rows ``[Td, features]`` (a row-strided
    view of the input projection is fine), the norm's ``weight`` and ``eps``, and
    ``group_size``, the features normalised together. Which norm it is belongs to the op: Gated
    DeltaNet normalises each value head and then gates (``rms_norm_gated``; ``weight``
    ``[group_size]``, shared by the heads), Mamba2 gates and then normalises each group
    (``rms_norm_gate_first``; ``weight`` ``[features]``). ``weight`` None: no norm, the gate
    alone (``silu_gate``; Mamba2 only)."""

    gate: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    group_size: int
