"""Linear weights in fp8 (``--quantization fp8``): float8 e4m3 codes with one fp32 scale per
block of 128 x 128 weights, the layout of the published FP8 checkpoints (``weight_block_size``
``[128, 128]``, ``weight_scale_inv``), computed with bf16 or fp32 activations (W8A16).

A decode step reads every weight once, so one byte a weight instead of two is up to half the
step. ``Fp8Weight`` stands where a linear's weight tensor stood; every backend's ``linear``
takes either. The reference (``linear``) dequantizes to the activations' dtype and runs the
dense linear: ``bf16(code * scale)``, exact in fp32. On a CPU with AVX-512 BF16 and VBMI a few
bf16 rows run in C straight from the codes (``csrc/linear_fp8.c``: each block's products summed
in fp32, times its scale), within bf16 rounding of the reference; more rows dequantize the
weight into a bf16 buffer (``dequantize_fp8``, the reference's numbers) and run the dense bf16
kernels.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mambaradix.kernels import native

BLOCK = 128  # the scale blocks' side
E4M3_MAX = 448.0  # the largest finite e4m3 value
# rows at most that the C kernel takes from the codes (it converts them again for each group of
# 4 rows: 16 rows took 0.85-1.06x the bf16 kernel's time); more rows dequantize the weight to
# bf16 first, a small cost beside a prefill chunk's matmuls
NATIVE_MAX_ROWS = 32


def quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """``w`` [N, K] -> (codes [N, K] float8_e4m3fn, scales [ceil(N/128), ceil(K/128)] fp32); a
    stack ``[E, N, K]`` (routed experts) each expert on its own grid (scales ``[E, ...]``):
    each block's scale is the power of two at or above its largest magnitude over 448 (1 for an
    all-zero block), each code the nearest e4m3 value of ``w / scale`` (ties to even).

    Powers of two: ``code * scale`` is then exact in bf16 (4 significant bits, shifted), so
    every path computes with the same weights: the C kernel's block sums times the scale, and
    the bf16 weights the many-row path and the reference dequantize to (with an arbitrary
    scale the two differ by the bf16 rounding of every weight, and a prompt resumed from the
    cache, whose short suffix takes the C kernel, would differ from one computed whole by
    more than bf16 noise). The price: a block's largest code is 224-448, not always 448; the
    relative step of e4m3 (2^-3) is the same, and only the smallest weights lose range."""
    if w.dim() == 3:  # expert by expert: 3x faster than one pass over the stack's temporaries
        parts = [quantize(e) for e in w]
        return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
    *lead, n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = F.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    blocks = padded.view(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)  # amax / 448 = mantissa * 2^exponent
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power: itself
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), exponent), 1.0)
    codes = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    codes = codes.to(torch.float8_e4m3fn).view(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k]
    return codes.contiguous(), scale.contiguous()


def dequantize(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``dtype(code * scale)``: the product in fp32 (exact: 4 significant bits times a float),
    rounded once. Codes ``[..., N, K]``, scales ``[..., ceil(N/128), ceil(K/128)]``."""
    n, k = codes.shape[-2:]
    s = scale.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
    return (codes.float() * s).to(dtype)


class Fp8Weight(nn.Module):
    """A linear's weight [out, in] as e4m3 codes (buffer ``q``) and block scales (``scale``);
    ``shape`` is the weight's. Moves with the model (``.to(device)``); in a state dict as
    ``<linear>.weight.q`` / ``.scale``. A stack of routed experts' weights ``[E, out, in]``
    has scales ``[E, ...]``; ``w[e]`` is expert ``e``'s (a view)."""

    def __init__(self, q: Tensor, scale: Tensor) -> None:
        super().__init__()
        if q.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise TypeError(f"fp8 weight needs float8_e4m3fn codes and fp32 scales, got "
                            f"{q.dtype} and {scale.dtype}")  # fmt: skip
        expected = self.spans(q.shape)[1][0]
        if q.dim() not in (2, 3) or tuple(scale.shape) != expected:
            raise ValueError(f"fp8 weight {tuple(q.shape)} needs scales {expected}, got "
                             f"{tuple(scale.shape)}")  # fmt: skip
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        # the C kernel's tables, shared by every weight (buffers: memory a recorded decode
        # step may read, engine/step_graph.py), not saved
        hi, lo = lut()
        self.register_buffer("lut_hi", hi, persistent=False)
        self.register_buffer("lut_lo", lo, persistent=False)

    @classmethod
    def from_dense(cls, w: Tensor, out: tuple[Tensor, Tensor] | None = None) -> Fp8Weight:
        """Quantize ``w`` (``quantize``); ``out``: tensors of the codes' and scales' shapes and
        dtypes to hold them (cut from a weight arena)."""
        q, scale = quantize(w)
        if out is not None:
            out[0].copy_(q)
            out[1].copy_(scale)
            q, scale = out
        return cls(q, scale)

    @staticmethod
    def spans(shape: torch.Size | tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The (shape, dtype) of the codes and of the scales of a weight (or stack) of
        ``shape``."""
        *lead, n, k = shape
        return [((*lead, n, k), torch.float8_e4m3fn),
                ((*lead, math.ceil(n / BLOCK), math.ceil(k / BLOCK)), torch.float32)]  # fmt: skip

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        return dequantize(self.q, self.scale, dtype)

    def __getitem__(self, e: int) -> Fp8Weight:
        """Expert ``e``'s weight of a stack (views of the codes and scales)."""
        return Fp8Weight(self.q[e], self.scale[e])

    def extra_repr(self) -> str:
        return f"{tuple(self.q.shape)}, e4m3, blocks {BLOCK}x{BLOCK}"


def linear(x: Tensor, weight: Tensor | Fp8Weight, bias: Tensor | None) -> Tensor:
    """The reference ``linear`` of every backend: ``F.linear``, an fp8 weight dequantized to
    ``x``'s dtype first."""
    if isinstance(weight, Fp8Weight):
        weight = weight.dequantize(x.dtype)
    return F.linear(x, weight, bias)


@functools.cache
def lut() -> tuple[Tensor, Tensor]:
    """The high and the low byte of each e4m3 magnitude's bf16 bits (codes 0..127; 127, a NaN,
    maps to 0: ``quantize`` never writes it)."""
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values[127] = 0.0
    bits = values.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (bits >> 8).to(torch.uint8).contiguous(), (bits & 0xFF).to(torch.uint8).contiguous()


@functools.cache
def _native():
    """The C library where it has the fp8 kernels (AVX-512 BF16 and VBMI), else None."""
    lib = native.load("linear_fp8")
    return lib if lib is not None and lib.linear_fp8_supported() else None


def _dequantize_native(weight: Fp8Weight) -> Tensor:
    """``weight.dequantize(torch.bfloat16)``, in C where the library builds (any CPU; the same
    numbers)."""
    lib = native.load("linear_fp8")
    if lib is None:
        return weight.dequantize(torch.bfloat16)
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16)
    lib.dequantize_fp8(
        n, k, weight.q.data_ptr(), weight.scale.data_ptr(), weight.lut_hi.data_ptr(),
        weight.lut_lo.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


def _chunks(k: int) -> int:
    """``k`` rounded up to the C kernel's chunks of 64 (its permuted rows' length)."""
    return -(-k // 64) * 64


def native_rows(m: int, k: int) -> bool:
    """Whether ``m`` bf16 rows of ``k`` run in C straight from the codes here."""
    return 0 < m <= NATIVE_MAX_ROWS and _native() is not None


def linear_cpu(
    x: Tensor, weight: Fp8Weight, bias: Tensor | None, dense: Callable[..., Tensor]
) -> Tensor:
    """The CPU backend's fp8 ``linear``: a few bf16 rows in C from the codes, else the weight
    dequantized to bf16 (in C) and ``dense(x, w, bias)`` (the backend's bf16 linear); other
    dtypes take the reference."""
    if x.dtype is not torch.bfloat16 or not x.is_cpu or not weight.q.is_cpu:
        return linear(x, weight, bias)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    if (
        rows.stride(1) != 1
        or not native_rows(m, k)
        or not (bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous()))
    ):
        return dense(x, _dequantize_native(weight), bias)
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    scratch = torch.empty(m * _chunks(k), dtype=torch.bfloat16)  # the rows permuted
    _native().linear_fp8(
        m, n, k, rows.data_ptr(), rows.stride(0), weight.q.data_ptr(), weight.scale.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), weight.lut_hi.data_ptr(),
        weight.lut_lo.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def moe_experts_cpu(
    x: Tensor, weights: Tensor, ids: Tensor, gate_up: Fp8Weight, down: Fp8Weight, act: str,
    gated: bool, max_pairs: int,
) -> Tensor | None:
    """The CPU backend's ``moe_experts`` over fp8 stacks for a decode batch of bf16 rows (at
    most ``max_pairs`` (token, expert) pairs), in one C call (``moe_experts_fp8``: only the
    routed experts' codes are read); None where it does not apply (the caller runs the
    reference's per-expert loop)."""
    covered = act in ("silu", "swish") if gated else act == "relu2"
    if not (isinstance(gate_up, Fp8Weight) and isinstance(down, Fp8Weight)) or not covered:
        return None
    T, K = ids.shape
    E, u, h = gate_up.shape
    i = u // 2 if gated else u
    fits = (
        x.dtype is torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1
        and tuple(x.shape) == (T, h) and tuple(down.shape) == (E, h, i)
        and 0 < T * K <= max_pairs
        and gate_up.q.is_cpu and _native() is not None
    )  # fmt: skip
    if not fits:
        return None
    P = T * K
    ids = ids.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    rows = torch.empty(P * (2 * h + u + i + _chunks(max(h, i))), dtype=torch.bfloat16)
    xs, gu = rows[: P * h], rows[P * h :]
    act_rows = gu[P * u :]
    y = act_rows[P * i :]
    xp = y[P * h :]
    idx = torch.empty(2 * P + 2 * E + 1, dtype=torch.int64)
    out = torch.empty(T, h, dtype=torch.bfloat16)
    _native().moe_experts_fp8(
        T, K, E, i, h, int(gated), x.data_ptr(), x.stride(0), ids.data_ptr(), w.data_ptr(),
        gate_up.q.data_ptr(), gate_up.scale.data_ptr(), down.q.data_ptr(),
        down.scale.data_ptr(), gate_up.lut_hi.data_ptr(), gate_up.lut_lo.data_ptr(),
        xs.data_ptr(), gu.data_ptr(), act_rows.data_ptr(), y.data_ptr(), xp.data_ptr(),
        idx.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out
