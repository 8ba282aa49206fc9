"""Host memory for the big tensors: pools that cost nothing until written, and weights on
transparent huge pages.

``torch.zeros`` writes every byte, so a 10 GB pool faults in 10 GB before the first request
(13.9 s of a 22.7 s start on Granite-4.0-H-350M with the default budget). A private anonymous
mapping is zero by definition and the kernel supplies each page on its first touch: start-up
pays for the pages it never uses nothing, and resident memory grows with what the cache holds.

A decode step streams every weight once, matrix by matrix, a few MB each. On 4 KB pages each
matrix crosses hundreds of page boundaries, where the hardware prefetchers stop and a TLB miss
waits: Falcon-H1-0.5B's Mamba2 input projection (6.9 MB) read at 35 GB/s on 4 KB pages and at
48-50 GB/s on 2 MB ones (AMD EPYC, Zen 4; a plain read of 1 GiB: 53-57 GB/s). So the loader
cuts every parameter from one ``WeightArena``: one mapping, aligned to 2 MB and advised
``MADV_HUGEPAGE`` before its first touch. Where the kernel gives no huge pages (transparent huge
pages ``never``, or no 2 MB page free) the same mapping simply has 4 KB pages.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

# below this a mapping's page rounding and bookkeeping outweigh what it saves
MAPPED_MIN_BYTES = 1 << 20
HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor of an arena starts on a cache line
# MAMBARADIX_HUGE_PAGES=0: weights on ordinary pages (for A/B runs; docs/benchmarks.md)
HUGE_PAGES = os.environ.get("MAMBARADIX_HUGE_PAGES", "1") != "0"


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A zero tensor; on the CPU, backed by an anonymous mapping faulted in page by page. The
    tensor holds the mapping; it is unmapped when the last view of the tensor is freed."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < MAPPED_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def advise_huge_pages(buf: mmap.mmap) -> bool:
    """Ask the kernel for transparent huge pages over ``buf`` (before it is touched: pages
    already faulted in stay small until khugepaged, maybe, collapses them). False where the
    platform or the kernel refuses; the mapping works either way."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not HUGE_PAGES:
        return False
    try:
        buf.madvise(advice)
    except OSError:
        return False
    return True


class WeightArena:
    """Contiguous tensors cut one after another from one anonymous mapping of ``nbytes`` (plus
    alignment), starting on a 2 MB boundary and advised for huge pages.

    Every tensor cut holds the whole mapping: it is unmapped when the last of them is freed,
    so a parameter replaced later leaves its bytes unused but mapped until then."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge = advise_huge_pages(self._map)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE_PAGE
        self._bytes = raw[start : start + nbytes]
        self.capacity, self.used = nbytes, 0

    @staticmethod
    def span(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> int:
        """The bytes ``take(shape, dtype)`` uses, alignment included."""
        return -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor (zeros, if its pages were never written)."""
        nbytes = math.prod(shape) * dtype.itemsize
        end = self.used + self.span(shape, dtype)
        if end > self.capacity:
            raise ValueError(f"arena of {self.capacity} bytes has {self.capacity - self.used} "
                             f"left, {nbytes} asked")  # fmt: skip
        out = self._bytes[self.used : self.used + nbytes].view(dtype).view(shape)
        self.used = end
        return out
