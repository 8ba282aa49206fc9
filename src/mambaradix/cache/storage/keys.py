"""Content-addressed keys of the storage tier: hash chains over token ids, salted with the
model's fingerprint.

Tokens are cut into blocks of ``block`` tokens (the snapshot alignment, a whole number of KV
pages). The digest after block i is ``H(digest after block i-1 || tokens of block i)``, starting
from ``H(fingerprint)``, so a digest names one exact token prefix of one exact model::

    tokens   |-- block 0 --|-- block 1 --|-- block 2 --|- tail -|
    digests  d0            d1            d2            d3       (P = 3 * block + tail)
    objects  kv-<d1>       kv-<d2>       kv-<d3>       st-<H(d3 || tail)>
             = KV(block 0) = KV(block 1) = KV(block 2) = state(P) + KV(tail)

A KV block object is keyed by the digest at its end; a state snapshot at position P by the
digest at ``align_down(P)`` extended with the tail tokens. Any process serving the same model
(same fingerprint) finds a prefix from its tokens alone, with no index to rebuild.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np
import torch

from mambaradix.core import KVSpec, StateSpec

LAYOUT_VERSION = 1  # bump when the object layout or the key scheme changes
_DIGEST = 20


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST)
    for p in parts:
        h.update(p)
    return h.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).astype("<i8", copy=False).tobytes()


class KeyChain:
    """Digests and object keys for one model fingerprint and block size."""

    def __init__(self, fingerprint: str, block: int) -> None:
        if block < 1:
            raise ValueError(f"storage block must be >= 1 token, got {block}")
        self.fingerprint = fingerprint
        self.block = block
        self.root = _h(b"mambaradix-chain", fingerprint.encode())

    def digests(self, tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        """``[d0, d1, ..., d_num_blocks]``: the digest before block 0 and after each block."""
        b = self.block
        if num_blocks * b > len(tokens):
            raise ValueError(f"{num_blocks} blocks of {b} need {num_blocks * b} tokens")
        raw = _token_bytes(tokens[: num_blocks * b])
        step = 8 * b
        out = [self.root]
        for i in range(num_blocks):
            out.append(_h(out[-1], raw[i * step : (i + 1) * step]))
        return out

    @staticmethod
    def kv_key(digest: bytes) -> str:
        """The KV block ending where ``digest`` was taken."""
        return "kv-" + digest.hex()

    @staticmethod
    def state_key(aligned_digest: bytes, tail: Sequence[int]) -> str:
        """The state after ``tail`` tokens past the block boundary of ``aligned_digest``."""
        return "st-" + _h(aligned_digest, b"state", _token_bytes(tail)).hex()

    def state_key_at(self, tokens: Sequence[int], position: int) -> str:
        nb = position // self.block
        d = self.digests(tokens, nb)[-1]
        return self.state_key(d, tokens[nb * self.block : position])


def model_fingerprint(
    model: torch.nn.Module,
    kv_spec: KVSpec,
    state_spec: StateSpec,
    *,
    block: int,
    page_size: int,
    samples: int = 64,
) -> str:
    """A short hex name of what a stored object depends on: the architecture, the weights'
    identity (every parameter's name, shape and dtype, and ``samples`` values spread over it:
    two seeds or two fine-tunes of one architecture differ), the KV and state layouts and
    dtypes, the block and page sizes and the layout version. Costs a few ms at real sizes."""
    h = hashlib.blake2b(digest_size=16)
    desc = {
        "version": LAYOUT_VERSION,
        "arch": type(model).__name__,
        "config": getattr(getattr(model, "config", None), "model_type", None),
        "kv": [kv_spec.num_layers, kv_spec.num_kv_heads, kv_spec.head_dim, str(kv_spec.dtype)],
        "state": [
            [
                list(s.conv_shape),
                list(s.temporal_shape or ()),
                str(s.conv_dtype),
                str(s.temporal_dtype),
            ]
            for s in state_spec.layers
        ],  # fmt: skip
        "block": block,
        "page": page_size,
    }
    h.update(json.dumps(desc, sort_keys=True).encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict(keep_vars=False).items()):
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
            if p.is_meta or p.numel() == 0:
                continue
            flat = p.reshape(-1)
            stride = max(1, flat.numel() // samples)
            sample = flat[::stride][:samples].detach().to("cpu", torch.float32).contiguous()
            h.update(sample.numpy().tobytes())
    return h.hexdigest()
