"""A test backend that can write a state inside a prefill forward only at multiples of a stride
(like a chunked GPU kernel that keeps its chunk-boundary states), and refuses anything else.

``strided_backend(stride, base)`` registers a subclass of ``base`` (the ``torch`` reference or
the native ``cpu`` backend: its ops compute the reference's results) whose capabilities declare
``snapshot_stride``; its ``prepare`` raises ``OffStrideSnapshot`` for any prefill snapshot
that is neither at a multiple of the stride of the forward's new tokens nor its last token, and
counts the snapshots it was given. The registration is undone when the context ends, so the
backend never leaks into other tests' ``backend_names()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mambaradix.kernels import backend as registry
from mambaradix.kernels.capabilities import BackendCapabilities
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layout import ForwardLayout


class OffStrideSnapshot(AssertionError):
    """The planner asked the backend for a snapshot it declared it cannot write."""


class StrideCounts:
    """What the strided backends of one registration were given (shared by every instance)."""

    def __init__(self) -> None:
        self.inside = 0  # prefill snapshots at a stride multiple before the forward's end
        self.at_end = 0  # prefill snapshots at the forward's last token
        self.forwards = 0  # prefill forwards
        self.refused: list[tuple[int, int]] = []  # (offset, forward length) asked off-stride


def check_snapshots(layout: ForwardLayout, stride: int, counts: StrideCounts) -> None:
    """Raise ``OffStrideSnapshot`` if a prefill snapshot of ``layout`` falls off the stride."""
    pre = layout.prefill
    if pre is None:
        return
    counts.forwards += 1
    for seg, offset in zip(pre.snapshot_seqs, pre.snapshot_offsets):
        n = pre.lens[seg]
        if offset == n:
            counts.at_end += 1
        elif offset % stride == 0:
            counts.inside += 1
        else:
            counts.refused.append((offset, n))
            raise OffStrideSnapshot(
                f"snapshot after {offset} of a forward's {n} new tokens: this backend writes "
                f"states inside a forward only every {stride} tokens"
            )


@contextmanager
def strided_backend(
    stride: int, base: type[TorchBackend] | None = None, name: str | None = None
) -> Iterator[tuple[str, StrideCounts]]:
    """Register a backend snapshotting only every ``stride`` tokens; yields (name, counts)."""
    base = base or TorchBackend
    name = name or f"strided{stride}_{base.name}"
    counts = StrideCounts()

    class StridedBackend(base):  # type: ignore[misc, valid-type]
        capabilities = BackendCapabilities(snapshot_stride=stride)

        def prepare(self, layout: ForwardLayout) -> None:
            check_snapshots(layout, stride, counts)
            super().prepare(layout)

    registry.register_backend(name)(StridedBackend)
    try:
        yield name, counts
    finally:
        registry._BACKENDS.pop(name, None)
