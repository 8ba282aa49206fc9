"""Request table rows: alloc, free, shortage and double free."""

from __future__ import annotations

import pytest
import torch

from mambaradix.cache.req_slots import ReqSlots


def test_rows_alloc_free_and_exhaustion():
    rs = ReqSlots(3, 16)
    assert rs.table.shape == (3, 16) and rs.table.dtype == torch.long
    rows = [rs.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and rs.available() == 0
    assert rs.alloc() is None and rs.available() == 0
    rs.free(rows[1])
    assert rs.available() == 1
    assert rs.alloc() == rows[1] and rs.available() == 0  # the freed row, and only it


def test_double_free_and_bad_row_raise():
    rs = ReqSlots(2, 4)
    r = rs.alloc()
    rs.free(r)
    with pytest.raises(ValueError):
        rs.free(r)
    with pytest.raises(ValueError):
        rs.free(5)
    assert rs.available() == 2
    with pytest.raises(ValueError):
        ReqSlots(0, 4)
