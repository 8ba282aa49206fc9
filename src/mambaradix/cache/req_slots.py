"""Request table: one row per running request mapping its token positions to KV slots."""

from __future__ import annotations

import torch

from mambaradix.host_memory import lazy_zeros


class ReqSlots:
    """Contract: ``alloc()`` returns a free row or None when all rows are in use (nothing is
    taken then); ``free(row)`` returns a row (raises ValueError if it is not in use).
    ``table[row, i]`` is the KV slot of the request's token i; rows are not cleared on free."""

    def __init__(self, num_rows: int, max_context_len: int, device: str | torch.device = "cpu"):
        if num_rows < 1 or max_context_len < 1:
            raise ValueError(
                f"request table needs >= 1 row and context length, got {num_rows} x "
                f"{max_context_len}"
            )
        self.num_rows = num_rows
        self.max_context_len = max_context_len
        self.table = lazy_zeros((num_rows, max_context_len), torch.long, device)
        self._free: list[int] = list(range(num_rows - 1, -1, -1))  # pop() hands out low rows
        self._in_use = [False] * num_rows

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        if not (0 <= row < self.num_rows) or not self._in_use[row]:
            raise ValueError(f"request row {row} is not in use (double free or bad row)")
        self._in_use[row] = False
        self._free.append(row)

    def available(self) -> int:
        return len(self._free)
