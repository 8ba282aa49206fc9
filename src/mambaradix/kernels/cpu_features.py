"""What this CPU can do fast, from /proc/cpuinfo (Linux; elsewhere: assume nothing)."""

from __future__ import annotations

import functools
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # instructions oneDNN's bf16 GEMMs are built on


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def fast_bf16_matmul() -> bool:
    """Whether bf16 matmuls run in hardware here. Without AVX512-BF16 or AMX, torch's CPU bf16
    GEMM is a scalar fallback (~0.3 GFLOP/s against ~17 in fp32 on a 2-core AVX2 machine):
    a bf16 checkpoint is then better computed in fp32."""
    return any(f in cpu_flags() for f in BF16_FLAGS)


def x86_without_bf16() -> bool:
    """An x86 CPU without bf16 instructions (AVX2, or AVX-512 without BF16): torch's bf16
    matmul is a fallback there (8 GFLOP/s against 41 in fp32 from bf16 copies on a 2-core
    AVX2 EPYC), so nothing needs measuring to know fp32 wins."""
    flags = cpu_flags()
    return "sse2" in flags and not fast_bf16_matmul()
