"""Snapshot planning: where a request's recurrent state is saved (design.md section 5).

Positions are sequence lengths (the state after that many tokens), multiples of the snapshot
alignment ``max(64, page_size)`` (rounded up to whole pages), and below the request's length, so
that a later request can resume there and still compute at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mambaradix.core import NO_BUFFER
from mambaradix.kernels.capabilities import BackendCapabilities


def snapshot_alignment(page_size: int, chunk: int = 64) -> int:
    return page_size * max(1, -(-chunk // page_size))


def align_down(x: int, a: int) -> int:
    return x // a * a


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(slots=True)
class Segment:
    end: int  # the forward computes tokens [start, end)
    snapshot: int | None  # absolute position whose state this forward saves (None: none)


def admission_targets(
    *,
    seq_len: int,
    prefix_len: int,
    kv_len: int,
    queue_branch: int,
    align: int,
    repeat_align: int | None = None,
    branches: set[int] | None = None,
) -> list[int]:
    """Snapshot positions a newly admitted request aims for, sorted: the branch point revealed
    by the lookup, the branch point shared with waiting requests, and the exact-repeat point.

    The repeat point is ``seq_len - 1`` rounded down to ``repeat_align`` (default ``align``): a
    tracking slot can take any position inside the last forward at no extra cost, so under
    ``extra_buffer`` it is the page size (1: exactly ``seq_len - 1``). ``branches``: the
    caller's ``branch_points`` of the same arguments, if it has them.
    """
    if branches is None:
        branches = branch_points(seq_len, prefix_len, kv_len, queue_branch, align)
    wanted = set(branches)
    wanted.add(align_down(seq_len - 1, repeat_align or align))  # exact repeat
    return sorted(w for w in wanted if w > prefix_len)


def branch_points(
    seq_len: int, prefix_len: int, kv_len: int, queue_branch: int, align: int
) -> set[int]:
    """Of ``admission_targets``, the positions where requests go on in different ways: the
    branch point the lookup revealed and the one shared with waiting requests."""
    limit = seq_len - 1
    points = {
        align_down(min(kv_len, limit), align),  # lookup branch (mid-edge or tombstone)
        align_down(min(queue_branch, limit), align),  # in-batch sharing
    }
    return {p for p in points if p > prefix_len}


def plan_forward(
    start: int,
    chunk_end: int,
    seq_len: int,
    wanted: list[int],
    align: int,
    strategy: str,
    capabilities: BackendCapabilities | None = None,
) -> Segment:
    """Choose where this forward ends and which position it snapshots.

    ``no_buffer`` snapshots only at a forward's end (the working state is copied afterwards), so
    the forward is cut at the first wanted position. ``extra_buffer`` writes one state per forward
    into a tracking slot, anywhere inside that the backend can write one
    (``capabilities.can_snapshot``; elsewhere the forward ends at the snapshot); with two wanted
    positions the forward ends at the first. A non-final chunk with no wanted position snapshots
    the aligned position inside it (so a long prompt stays reusable if the request is retracted).
    """
    inside = [w for w in wanted if start < w <= chunk_end]
    if chunk_end < seq_len and not inside:
        c = align_down(chunk_end, align)
        if c > start:
            inside.append(c)
    if not inside:
        return Segment(chunk_end, None)
    snap = inside[0]
    if strategy == NO_BUFFER or len(inside) > 1:
        return Segment(snap, snap)
    caps = capabilities or BackendCapabilities()
    if not caps.can_snapshot(snap - start, chunk_end - start):
        return Segment(snap, snap)  # the backend writes it only as the forward's final state
    return Segment(chunk_end, snap)
