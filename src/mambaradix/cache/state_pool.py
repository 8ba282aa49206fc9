"""Recurrent-state pool: per slot, a conv state and an optional temporal state per layer.

The pool knows only a model-agnostic ``StateSpec``; models index ``conv[layer][slot]`` and
``temporal[layer][slot]`` directly. Only the runner (through ``apply``) and tests write states.
"""

from __future__ import annotations

import torch

from mambaradix.core import StateOps, StateSpec
from mambaradix.host_memory import lazy_zeros
from mambaradix.layout import to_device


class StatePool:
    """Contract: ``alloc(n)`` returns n distinct free slots or None (nothing taken) when fewer
    than n are free; ``free`` returns slots; ``copy(src, dst)`` and ``clear(slots)`` are batched
    over all layers. ``copies``/``copied_bytes`` count every executed slot copy.

    ``scratch`` extra slots past ``size`` (``scratch_slot`` the first) are never handed out: a
    captured decode step's padding rows write their states there (``engine.cuda_graphs``)."""

    def __init__(
        self, spec: StateSpec, size: int, device: str | torch.device = "cpu", scratch: int = 0
    ) -> None:
        if size < 1:
            raise ValueError(f"state pool needs at least 1 slot, got {size}")
        self.spec = spec
        self.size = size
        self.scratch_slot = size
        self.device = torch.device(device)
        rows = size + scratch
        self.conv = [
            lazy_zeros((rows, *s.conv_shape), s.conv_dtype, self.device) for s in spec.layers
        ]
        self.temporal = [
            None
            if s.temporal_shape is None
            else lazy_zeros((rows, *s.temporal_shape), s.temporal_dtype, self.device)
            for s in spec.layers
        ]
        self._free: list[int] = list(range(size - 1, -1, -1))
        self.copies = 0
        self.copied_bytes = 0

    @property
    def slot_bytes(self) -> int:
        return self.spec.slot_bytes()

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        return taken[::-1]

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def free_slot_list(self) -> list[int]:
        return list(self._free)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in self.conv] + [t for t in self.temporal if t is not None]

    def copy(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        s = to_device(torch.tensor(src, dtype=torch.long), self.device)
        d = to_device(torch.tensor(dst, dtype=torch.long), self.device)
        for t in self._tensors():
            t.index_copy_(0, d, t.index_select(0, s))
        self.copies += len(src)
        self.copied_bytes += len(src) * self.slot_bytes

    def clear(self, slots: list[int]) -> None:
        if not slots:
            return
        idx = to_device(torch.tensor(slots, dtype=torch.long), self.device)
        for t in self._tensors():
            t.index_fill_(0, idx, 0)

    def apply(self, ops: StateOps) -> None:
        """Run a batch's deferred operations: loads' pool writes, copies, then clears."""
        for write in ops.writes:
            write()
        self.copy(ops.copy_src, ops.copy_dst)
        self.clear(ops.clear)
