"""What a kernel backend can do, as the planner and the engine read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    """``snapshot_stride``: a backend writes a recurrent state *inside* a prefill forward only
    after a multiple of this many of the forward's new tokens (1: after any token; a chunked
    GPU kernel that keeps its chunk-boundary states: its chunk size). The state after a
    forward's last token can always be written. The planner ends a forward at a wanted
    snapshot it could not take inside one.
    """

    snapshot_stride: int = 1

    def __post_init__(self) -> None:
        if self.snapshot_stride < 1:
            raise ValueError(f"snapshot_stride must be >= 1, got {self.snapshot_stride}")

    def can_snapshot(self, offset: int, extend_len: int) -> bool:
        """Whether the state after ``offset`` of a forward's ``extend_len`` new tokens can be
        written by that forward (``1 <= offset <= extend_len``)."""
        return offset == extend_len or offset % self.snapshot_stride == 0
