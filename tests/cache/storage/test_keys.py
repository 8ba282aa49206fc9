"""Content keys: a digest names one exact token prefix of one exact model."""

from __future__ import annotations

import torch

from mambaradix.cache.storage.keys import KeyChain, model_fingerprint
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec

KV = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8)
STATE = StateSpec((StateLayerSpec((16, 3), (2, 4, 4)),))


def test_chain_depends_on_every_earlier_token():
    chain = KeyChain("fp", 4)
    a = list(range(20))
    b = a[:9] + [99] + a[10:]  # differs in block 2 only
    da, db = chain.digests(a, 5), chain.digests(b, 5)
    assert da[:3] == db[:3]  # blocks 0 and 1 (and the root) are shared
    assert all(x != y for x, y in zip(da[3:], db[3:]))  # every later digest differs
    assert chain.digests(a[:8], 2) == da[:3]  # a prefix's digests are the prefix of the chain


def test_state_keys_name_position_tail_and_model():
    chain = KeyChain("fp", 4)
    t = list(range(3, 30))
    keys = {chain.state_key_at(t, p) for p in range(1, 27)}
    assert len(keys) == 26  # one key per position
    assert chain.state_key_at(t, 10) == chain.state_key_at(t[:10] + [7, 7], 10)
    assert chain.state_key_at(t, 10) != chain.state_key_at(t[:9] + [7], 10)
    assert KeyChain("other", 4).state_key_at(t, 10) != chain.state_key_at(t, 10)
    assert KeyChain("fp", 8).state_key_at(t, 10) != chain.state_key_at(t, 10)
    assert chain.kv_key(b"\x00").startswith("kv-") and chain.state_key(b"", []).startswith("st-")


def test_fingerprint_follows_weights_dtypes_and_layout():
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    fp = lambda m=model, **kw: model_fingerprint(
        m, kw.get("kv", KV), STATE, block=64, page_size=kw.get("page", 1)
    )  # noqa: E731
    base = fp()
    assert fp() == base  # deterministic
    other = torch.nn.Linear(32, 32)  # same architecture, other weights
    assert fp(other) != base
    with torch.no_grad():
        model.weight[5, 0] += 1.0  # one of the 64 sampled values (every 16th here)
    changed = fp()
    assert changed != base
    assert fp(page=16) != changed
    assert fp(kv=KVSpec(2, 2, 8, torch.bfloat16)) != changed
    assert model_fingerprint(model, KV, StateSpec((StateLayerSpec((16, 3), (2, 4, 4),
             temporal_dtype=torch.bfloat16),)), block=64, page_size=1) != changed  # fmt: skip
