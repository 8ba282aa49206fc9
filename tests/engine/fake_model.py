"""A deterministic stand-in model that follows the model contract exactly.

Two recurrent layers and two attention layers. Every token's logits depend on the full
recurrent history of both layers, on the **conv state** of both (layer 0's conv holds the last
token, which layer 1's update reads; layer 1's conv feeds the logits), and on every earlier
token's V in both attention layers (through the KV pool), so a wrong resume, a stale or missing
copy of either state tensor of either layer, or a wrong KV slot changes the output. K holds the
token's position and is checked on every read: a row pointing at the wrong slot raises at once.

``expected_greedy`` computes the same outputs in closed form from the token ids alone: a
reference that shares nothing with the engine's scheduler, cache, runner or sampler.
"""

from __future__ import annotations

import torch

from mambaradix.core import KVSpec, StateLayerSpec, StateSpec
from mambaradix.layout import ForwardContext

VOCAB = 61
MOD = 10007
HIGH, LOW = 10.0, 5.0  # the two logits a row holds; the rest are 0

State = tuple[int, int, int, int]  # (layer 0 temporal, layer 0 conv, layer 1 temporal, conv)


def advance(state: State, token: int) -> State:
    """One token through both recurrent layers."""
    a0, c0, a1, c1 = state
    a0 = (a0 * 31 + token + 1) % MOD
    a1 = (a1 * 17 + c0 * 5 + a0 + token) % MOD  # reads the previous token from layer 0's conv
    c1 = (token + c0) % VOCAB
    return a0, token, a1, c1


def v_entries(pos: int, token: int) -> tuple[int, int]:
    """What the token writes into V of attention layers 0 and 1."""
    return token + 1, (pos + 1) * (token + 1) % MOD


def logit_row(state: State, kv_sums: tuple[int, int]) -> torch.Tensor:
    a0, _, a1, c1 = state
    row = torch.zeros(VOCAB)
    row[(a1 * 7 + kv_sums[0] + 3 * kv_sums[1]) % VOCAB] = HIGH
    row[(a0 * 3 + c1 + 1) % VOCAB] += LOW
    return row


def expected_greedy(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy output ids and their logprobs, straight from the recurrence."""
    state: State = (0, 0, 0, 0)
    sums = [0, 0]
    seq = list(prompt)
    out: list[int] = []
    lps: list[float] = []
    pos = 0
    while len(out) < n:
        for t in seq[pos:]:
            state = advance(state, t)
            v0, v1 = v_entries(pos, t)
            sums[0] += v0
            sums[1] += v1
            pos += 1
        row = logit_row(state, (sums[0], sums[1]))
        tok = int(torch.argmax(row))
        out.append(tok)
        lps.append(float(torch.log_softmax(row.double(), -1)[tok]))
        seq.append(tok)
    return out, lps


class FakeModel(torch.nn.Module):
    vocab_size = VOCAB
    kv_spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=1)
    state_spec = StateSpec(
        (
            StateLayerSpec(conv_shape=(1, 1), temporal_shape=(1, 1, 1)),
            StateLayerSpec(conv_shape=(1, 1), temporal_shape=(1, 1, 1)),
        )
    )
    max_position_embeddings = 1 << 14

    def __init__(self, eos_token_ids: list[int] | None = None) -> None:
        super().__init__()
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else [0]
        self.forwards = 0

    def _read_state(self, ctx: ForwardContext, slot: int) -> State:
        pool = ctx.state_pool
        return (
            int(pool.temporal[0][slot].item()),
            int(pool.conv[0][slot].item()),
            int(pool.temporal[1][slot].item()),
            int(pool.conv[1][slot].item()),
        )

    def _write_state(self, ctx: ForwardContext, slot: int, state: State) -> None:
        pool = ctx.state_pool
        pool.temporal[0][slot] = state[0]
        pool.conv[0][slot] = state[1]
        pool.temporal[1][slot] = state[2]
        pool.conv[1][slot] = state[3]

    def forward(self, ctx: ForwardContext, all_logits: bool = False) -> torch.Tensor:
        self.forwards += 1
        ks, vs = ctx.kv_pool.k, ctx.kv_pool.v
        rows = []
        for r in ctx.layout.reqs:
            prefix = r.kv_slots[: r.prefix_len]
            sums = [0, 0]
            if prefix.numel():
                want = torch.arange(r.prefix_len)
                for layer in range(2):
                    if not torch.equal(ks[layer][prefix, 0, 0].long(), want):
                        raise RuntimeError("fake model read KV of the wrong positions")
                    sums[layer] = int(vs[layer][prefix, 0, 0].double().sum().item())
            state = self._read_state(ctx, r.state_slot)
            snaps = dict(r.snapshots)
            new_v: list[list[int]] = [[], []]
            for j, t in enumerate(r.input_ids):
                pos = r.prefix_len + j
                state = advance(state, t)
                for layer, v in enumerate(v_entries(pos, t)):
                    new_v[layer].append(v)
                    sums[layer] += v
                if j + 1 in snaps:
                    self._write_state(ctx, snaps[j + 1], state)
                if all_logits or r.all_logits or j == len(r.input_ids) - 1:
                    rows.append(logit_row(state, (sums[0], sums[1])))
            if r.input_ids:  # this request's new K/V, one write per layer
                new = r.kv_slots[r.prefix_len : r.prefix_len + len(r.input_ids)]
                positions = torch.arange(r.prefix_len, r.prefix_len + len(r.input_ids))
                for layer in range(2):
                    ks[layer][new, 0, 0] = positions.to(ks[layer].dtype)
                    vs[layer][new, 0, 0] = torch.tensor(new_v[layer], dtype=vs[layer].dtype)
            self._write_state(ctx, r.state_slot, state)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)
