"""The stored object format: a checked header, then raw tensor bytes. Never pickle.

::

    b"MRXOBJ01" | u32 header length | header (UTF-8 JSON) | payload (tensors back to back)

The header names the object's key, the model fingerprint, its kind, every tensor (name, dtype,
shape) in payload order, the payload's length and its CRC-32. ``decode`` checks all of it
against what the reader expects (the key it asked for, its own fingerprint, the exact tensor
list its pools need) before one byte reaches a pool; any mismatch raises ``BadObject``, which
the tier treats as a miss.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from collections.abc import Sequence

import torch

MAGIC = b"MRXOBJ01"
MAX_HEADER = 1 << 20
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_NAMES = {v: k for k, v in _DTYPES.items()}

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]


class BadObject(ValueError):
    """A stored object that must not be used (truncated, corrupt, foreign, wrong layout)."""


def _raw(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def encode(
    key: str, fingerprint: str, kind: str, tensors: Sequence[tuple[str, torch.Tensor]]
) -> list[memoryview | bytes]:
    """The object's parts (header, then each tensor's bytes, not joined: a backend writes them
    one after another)."""
    parts = [_raw(t) for _, t in tensors]
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    header = {
        "key": key,
        "fingerprint": fingerprint,
        "kind": kind,
        "tensors": [
            {"name": n, "dtype": _NAMES[t.dtype], "shape": list(t.shape)} for n, t in tensors
        ],
        "payload_bytes": sum(p.nbytes for p in parts),
        "crc32": crc,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return [MAGIC + struct.pack("<I", len(head)) + head, *parts]


def encoded_size(parts: Sequence[memoryview | bytes]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def decode(
    data: bytes | memoryview,
    *,
    key: str,
    fingerprint: str,
    kind: str,
    expected: Sequence[TensorSpec],
) -> dict[str, torch.Tensor]:
    """The object's tensors (views of ``data``: copy them into the pools), after checking every
    field against the reader's expectations. Raises ``BadObject`` naming the first mismatch."""
    view = memoryview(data)
    if view.nbytes < len(MAGIC) + 4 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise BadObject("not a mambaradix object (magic)")
    (hlen,) = struct.unpack_from("<I", view, len(MAGIC))
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > view.nbytes:
        raise BadObject(f"header length {hlen} out of range (object of {view.nbytes} bytes)")
    try:
        header = json.loads(bytes(view[start : start + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadObject(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise BadObject("header is not an object")
    for field, want in (("key", key), ("fingerprint", fingerprint), ("kind", kind)):
        if header.get(field) != want:
            raise BadObject(f"{field} {header.get(field)!r} is not the expected {want!r}")
    specs = header.get("tensors")
    want_specs = [{"name": n, "dtype": _NAMES[d], "shape": list(s)} for n, d, s in expected]
    if specs != want_specs:
        raise BadObject("tensor list differs from this model's layout")
    payload = view[start + hlen :]
    sizes = [
        int(torch.Size(s).numel()) * torch.empty(0, dtype=d).element_size() for _, d, s in expected
    ]
    if header.get("payload_bytes") != sum(sizes) or payload.nbytes != sum(sizes):
        raise BadObject(
            f"payload is {payload.nbytes} bytes; the header says {header.get('payload_bytes')}, "
            f"the layout needs {sum(sizes)}"
        )
    if zlib.crc32(payload) != header.get("crc32"):
        raise BadObject("checksum mismatch")
    out: dict[str, torch.Tensor] = {}
    off = 0
    for (name, dtype, shape), size in zip(expected, sizes):
        chunk = payload[off : off + size]
        off += size
        if size == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only bytes: the caller copies, never writes
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(chunk, dtype=torch.uint8)
        out[name] = raw.view(dtype).view(shape)
    return out
