"""RMSNorm variants: plain (``x * w``), zero-centred (``x * (1 + w)``, Qwen3-Next / Qwen3.5),
and gated (normalise then multiply by ``silu(gate)``, or gate first; optionally per group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mambaradix.kernels.norm import GatedNorm, rms_normalize
from mambaradix.layers.ops import KernelUser


class RMSNorm(KernelUser, nn.Module):
    """``zero_centered``: weight stored as an offset from 1 (initialised to 0) and the product is
    taken in fp32 before casting back; otherwise ``w * x.to(dtype)`` (Llama convention)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_and_norm(
        self, residual: torch.Tensor, x: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + x * scale`` and this norm of it, in one op: ``(h, norm(h))``."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered, scale)


class GatedRMSNorm(KernelUser, nn.Module):
    """``norm_before_gate``: ``w * norm(x) * silu(gate)`` (Gated DeltaNet); otherwise
    ``w * norm(x * silu(gate))`` (Mamba2). ``group_size`` normalises each group separately."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        norm_before_gate: bool = True,
        group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.group_size = group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def folded(self, gate: torch.Tensor) -> GatedNorm:
        """This norm with ``gate`` ``[T, features]``, for a decode op to finish with
        (``mamba2_mixer_decode``: gate first, per group; ``gdn_decode``: norm first, each
        head of ``dim`` features)."""
        return GatedNorm(gate, self.weight, self.eps, self.group_size or self.weight.numel())

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        whole = self.group_size is None or self.group_size == x.shape[-1]
        if self.norm_before_gate and whole:
            return self.ops.rms_norm_gated(x, gate, self.weight, self.eps)
        if self.norm_before_gate:
            y = self.weight * rms_normalize(x, self.eps, self.group_size).to(dtype)
            return (y * F.silu(gate.float())).to(dtype)
        return self.ops.rms_norm_gate_first(
            x, gate, self.weight, self.eps, self.group_size or x.shape[-1]
        )
