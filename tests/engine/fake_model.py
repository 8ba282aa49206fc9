"""A deterministic stand-in model that follows the model contract exactly.

Every token's logits depend on the full recurrent history (through the state in the working
slot) and on every earlier token's V (through the KV pool), so a wrong resume, a stale or
missing state copy, or a wrong KV slot changes the output. K holds the token's position and
is checked on every read: a row pointing at the wrong slot raises at once.
"""

from __future__ import annotations

import torch

from mambaradix.core import ForwardContext, KVSpec, StateLayerSpec, StateSpec

VOCAB = 61
MOD = 10007


class FakeModel(torch.nn.Module):
    vocab_size = VOCAB
    kv_spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1)
    state_spec = StateSpec((StateLayerSpec(conv_shape=(1, 1), temporal_shape=(1, 1, 1)),))
    max_position_embeddings = 1 << 14

    def __init__(self, eos_token_ids: list[int] | None = None) -> None:
        super().__init__()
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else [0]
        self.forwards = 0

    def forward(self, ctx: ForwardContext, all_logits: bool = False) -> torch.Tensor:
        self.forwards += 1
        k, v = ctx.kv_pool.k[0], ctx.kv_pool.v[0]
        conv, temporal = ctx.state_pool.conv[0], ctx.state_pool.temporal[0]
        rows = []
        for r in ctx.reqs:
            prefix = r.kv_slots[: r.prefix_len]
            if prefix.numel():
                got = k[prefix, 0, 0]
                want = torch.arange(r.prefix_len, dtype=got.dtype)
                if not torch.equal(got, want):
                    raise RuntimeError("fake model read KV of the wrong positions")
            kv_sum = int(v[prefix, 0, 0].sum().item())
            s = int(temporal[r.state_slot].item())
            snaps = dict(r.snapshots)
            for j, t in enumerate(r.input_ids):
                pos = r.prefix_len + j
                s = (s * 31 + t + 1) % MOD
                slot = r.kv_slots[pos]
                k[slot, 0, 0] = pos
                v[slot, 0, 0] = t + 1
                kv_sum += t + 1
                if j + 1 in snaps:
                    temporal[snaps[j + 1]] = s
                    conv[snaps[j + 1]] = t
                if all_logits or r.all_logits or j == len(r.input_ids) - 1:
                    row = torch.zeros(VOCAB)
                    row[(s * 7 + kv_sum) % VOCAB] = 10.0
                    row[(s * 3 + 1) % VOCAB] += 5.0
                    rows.append(row)
            temporal[r.state_slot] = s
            if r.input_ids:
                conv[r.state_slot] = r.input_ids[-1]
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)
