"""Attention KV pool: K and V tensors for every attention layer, addressed by slot index.

Allocation is in whole pages of ``page_size`` slots; slot ``s`` belongs to page
``s // page_size``. With ``page_size`` 1 every token is its own page.
"""

from __future__ import annotations

import torch

from mambaradix.core import KVSpec
from mambaradix.host_memory import lazy_zeros


class KVPool:
    """Contract: ``alloc(n)`` (n a multiple of page_size) returns n slot indices made of whole
    pages, or None when fewer are free (nothing is taken then). ``free(slots)`` returns the pages
    of the given slots; callers free whole pages, each exactly once. ``k[layer]`` and
    ``v[layer]`` are ``[size, num_kv_heads, head_dim]`` tensors, indexed by slot; with
    ``scratch`` pages more, past ``size`` (``scratch_slot`` the first slot), never handed out:
    a captured decode step's padding rows write there (``engine.cuda_graphs``)."""

    def __init__(
        self,
        spec: KVSpec,
        size: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        scratch: int = 0,
    ) -> None:
        if page_size < 1 or size % page_size:
            raise ValueError(
                f"KV pool size {size} must be a positive multiple of page_size {page_size}"
            )
        self.spec = spec
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.scratch_slot = size
        shape = (size + scratch * page_size, spec.num_kv_heads, spec.head_dim)
        self.k = [lazy_zeros(shape, spec.dtype, self.device) for _ in range(spec.num_layers)]
        self.v = [lazy_zeros(shape, spec.dtype, self.device) for _ in range(spec.num_layers)]
        # Stack of free page ids; popping from the end hands out low pages first.
        self._free_pages: list[int] = list(range(size // page_size - 1, -1, -1))
        self._page_offsets = torch.arange(page_size, dtype=torch.long)

    def available(self) -> int:
        """Free slots (always a multiple of page_size)."""
        return len(self._free_pages) * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        if n % self.page_size:
            raise ValueError(
                f"KV alloc of {n} slots is not a whole number of pages of {self.page_size}"
            )
        pages = n // self.page_size
        if pages > len(self._free_pages):
            return None
        if pages == 0:
            return torch.empty(0, dtype=torch.long)
        taken = self._free_pages[-pages:]
        del self._free_pages[-pages:]
        page_ids = torch.tensor(taken[::-1], dtype=torch.long)
        if self.page_size == 1:
            return page_ids
        return (page_ids[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if self.page_size == 1:
            self._free_pages.extend(slots.tolist())
        else:
            self._free_pages.extend((slots[:: self.page_size] // self.page_size).tolist())

    def free_slot_list(self) -> list[int]:
        """Every free slot (for integrity checks; O(size))."""
        if self.page_size == 1:
            return list(self._free_pages)
        p = self.page_size
        return [pg * p + i for pg in self._free_pages for i in range(p)]
