"""Reusable oracle harness: our runtime model vs transformers on a tiny random checkpoint.

Each architecture's test module builds ``OracleCase``s and calls the ``check_*`` functions (or
uses ``ORACLE_CHECKS`` to parametrize). transformers runs in fp32 with explicit
``position_ids`` and a ``DynamicCache``; recurrent states are read from that cache with
``get_conv_state`` / ``get_recurrent_state`` on the HF layer index of each recurrent layer.

``OracleCase`` hooks for architectures whose HF cache differs:
- ``hf_state_layers(config) -> list[int]``: HF layer index of our recurrent layer j (default: the
  layers whose ``layer_types`` entry is not an attention kind);
- ``hf_state(cache, layer_idx) -> (conv, temporal | None)`` in our pool layout (default: the two
  getters, batch dim dropped).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardReq
from mambaradix.layout import ForwardContext
from mambaradix.models.loader import load_model
from mambaradix.models.tiny import make_tiny_checkpoint

ATOL = 1e-4
ATTN_KINDS = ("full_attention", "attention", "sliding_attention", "*")


def default_state_layers(config: Any) -> list[int]:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [i for i, t in enumerate(cfg.layer_types) if t not in ATTN_KINDS]


def default_hf_state(cache: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    conv = cache.get_conv_state(layer_idx)
    rec = cache.get_recurrent_state(layer_idx)
    return conv[0], None if rec is None else rec[0]


@dataclass
class OracleCase:
    name: str
    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)
    hf_state_layers: Callable[[Any], list[int]] = default_state_layers
    hf_state: Callable[[Any, int], tuple[torch.Tensor, torch.Tensor | None]] = default_hf_state
    seed: int = 0

    def __str__(self) -> str:
        return self.name


class Oracle:
    """Our model + pools + the transformers model of the same checkpoint."""

    def __init__(
        self,
        case: OracleCase,
        folder: Path,
        kv_size: int = 4096,
        slots: int = 32,
        dtype: torch.dtype = torch.float32,
    ):
        """Both models in ``dtype`` (our temporal states stay fp32, as the engine's default)."""
        from transformers import AutoModelForCausalLM

        self.case = case
        self.model = load_model(str(folder), dtype=dtype)
        self.hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
        self.config = self.hf.config
        self.kv_size, self.num_slots = kv_size, slots
        self.reset()
        self.vocab = self.model.vocab_size
        self.state_layers = case.hf_state_layers(self.config)
        assert len(self.state_layers) == len(self.model.state_spec.layers)

    def reset(self) -> None:
        """Fresh, empty pools (each check starts from these)."""
        self.kv = KVPool(self.model.kv_spec, self.kv_size)
        self.states = StatePool(self.model.state_spec, self.num_slots)

    # ------------------------------------------------------------------ ours

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, self.vocab, (n,), generator=g).tolist()

    def new_request(self, capacity: int = 512) -> tuple[torch.Tensor, int]:
        kv = self.kv.alloc(capacity)
        (slot,) = self.states.alloc(1)
        self.states.clear([slot])
        assert kv is not None
        return kv, slot

    def forward(self, reqs: list[ForwardReq], all_logits: bool = True) -> torch.Tensor:
        ctx = ForwardContext.build(reqs, self.kv, self.states)
        return self.model(ctx, all_logits=all_logits)

    def run(self, tokens: list[int], kv: torch.Tensor, slot: int, prefix_len: int = 0,
            snapshots: list[tuple[int, int]] | None = None) -> torch.Tensor:  # fmt: skip
        """One request alone: compute ``tokens`` after ``prefix_len`` cached ones."""
        req = ForwardReq(prefix_len, list(tokens), kv, slot, list(snapshots or []))
        return self.forward([req])

    def slot_state(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [
            (c[slot].clone(), None if t is None else t[slot].clone())
            for c, t in zip(self.states.conv, self.states.temporal)
        ]

    # ------------------------------------------------------------------ transformers

    def _hf(self, ids: list[int], start: int, cache: Any) -> torch.Tensor:
        x = torch.tensor([ids])
        pos = torch.arange(start, start + len(ids))[None]
        with torch.no_grad():
            return self.hf(
                input_ids=x, position_ids=pos, cache=cache, use_cache=cache is not None
            ).logits[0]

    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        return self._hf(tokens, 0, None)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def hf_states_after(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        cache = self.new_cache()
        self._hf(tokens, 0, cache)
        out = []
        for j, i in enumerate(self.state_layers):
            conv, rec = self.case.hf_state(cache, i)
            # transformers keeps the last K conv inputs, we keep K-1 (the oldest is never read).
            k1 = self.states.conv[j].shape[-1]
            out.append((conv[..., conv.shape[-1] - k1 :], rec))
        return out


# ---------------------------------------------------------------------- checks


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, atol: float = ATOL) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    diff = (ours.float() - ref.float()).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3g} > {atol}"


def assert_states_close(ours, ref, what: str, atol: float = ATOL) -> None:
    for j, ((c, t), (rc, rt)) in enumerate(zip(ours, ref)):
        assert_close(c, rc, f"{what}: conv state of recurrent layer {j}", atol)
        if rt is not None or t is not None:
            assert t is not None and rt is not None, f"{what}: temporal state presence differs"
            assert_close(t, rt, f"{what}: temporal state of recurrent layer {j}", atol)


def check_full_prompt(o: Oracle, n: int = 300) -> None:
    toks = o.tokens(n, seed=1)
    kv, slot = o.new_request(n)
    assert_close(o.run(toks, kv, slot), o.hf_logits(toks), "full-prompt logits")


def check_resume(o: Oracle, prefix: int, extend: int = 44) -> None:
    """Pools holding the first ``prefix`` tokens (KV + a state copied into a fresh working slot,
    as the engine resumes) -> the next ``extend`` tokens match the full-prompt logits."""
    toks = o.tokens(prefix + extend, seed=2)
    ref = o.hf_logits(toks)
    kv, slot = o.new_request(prefix + extend)
    o.run(toks[:prefix], kv, slot)
    (work,) = o.states.alloc(1)
    o.states.copy([slot], [work])
    o.states.clear([slot])  # the original slot must not be what the resume reads
    out = o.run(toks[prefix:], kv, work, prefix_len=prefix)
    assert_close(out, ref[prefix:], f"resume after {prefix} tokens")


def check_decode(o: Oracle, prompt: int = 20, steps: int = 40) -> None:
    toks = o.tokens(prompt + steps, seed=3)
    cache = o.new_cache()
    kv, slot = o.new_request(prompt + steps)
    assert_close(o.run(toks[:prompt], kv, slot)[-1], o._hf(toks[:prompt], 0, cache)[-1],
                 "prompt logits")  # fmt: skip
    for i in range(prompt, prompt + steps):
        ours = o.run([toks[i]], kv, slot, prefix_len=i)
        ref = o._hf([toks[i]], i, cache)
        assert_close(ours, ref, f"decode step at position {i}")


def check_mixed_batch(o: Oracle) -> None:
    """Prefills with different cached lengths + decodes in one forward == each alone."""
    plan = [  # (prefix_len, extend_len, snapshot offsets)
        (0, 37, [5]),
        (64, 20, [20]),
        (3, 100, [1, 64]),
        (10, 1, []),
        (70, 1, [1]),
        (0, 1, []),
        (130, 1, []),
    ]
    reqs, snap_slots = [], []
    for k, (p, n, snaps) in enumerate(plan):
        toks = o.tokens(p + n, seed=10 + k)
        kv, slot = o.new_request(p + n)
        if p:
            o.run(toks[:p], kv, slot)
        ss = o.states.alloc(len(snaps))
        snap_slots += ss
        reqs.append(ForwardReq(p, toks[p:], kv, slot, list(zip(snaps, ss))))
    saved_c = [c.clone() for c in o.states.conv]
    saved_t = [None if t is None else t.clone() for t in o.states.temporal]
    together = o.forward(reqs)
    after = {s: o.slot_state(s) for r in reqs for s in [r.state_slot, *snap_slots]}
    for c, sc in zip(o.states.conv, saved_c):
        c.copy_(sc)
    for t, st in zip(o.states.temporal, saved_t):
        if t is not None:
            t.copy_(st)
    alone = torch.cat([o.forward([r]) for r in reqs])
    assert_close(together, alone, "mixed batch logits vs each request alone", atol=1e-5)
    for s, st in after.items():
        assert_states_close(st, o.slot_state(s), f"mixed batch slot {s}", atol=1e-5)


def check_snapshots(o: Oracle, n: int = 100, points=(1, 2, 3, 64, 65, 99, 100)) -> None:
    """Snapshots at offsets p equal transformers' states after p tokens; they do not change the
    logits; a resumed request snapshots with its carried-in conv state."""
    toks = o.tokens(n, seed=4)
    kv, slot = o.new_request(n)
    snaps = list(zip(points, o.states.alloc(len(points))))
    out = o.run(toks, kv, slot, snapshots=snaps)
    assert_close(out, o.hf_logits(toks), "logits of a forward with snapshots")
    for p, s in snaps:
        assert_states_close(o.slot_state(s), o.hf_states_after(toks[:p]), f"snapshot at {p}")
    assert_states_close(o.slot_state(slot), o.hf_states_after(toks), "final working state")
    # Chunk-boundary snapshots come out of the kernel without a cut: 64 and 128 inside the
    # first piece, 129 cuts, 193 is a boundary of the piece that starts at 129.
    toks3 = o.tokens(200, seed=5)
    kv3, slot3 = o.new_request(200)
    snaps3 = list(zip((64, 128, 129, 193), o.states.alloc(4)))
    o.run(toks3, kv3, slot3, snapshots=snaps3)
    for p, s in snaps3:
        assert_states_close(o.slot_state(s), o.hf_states_after(toks3[:p]), f"snapshot at {p}")
    # Resumed: prefix 2 (< conv kernel - 1), snapshot after 1 more token and after 70.
    kv2, slot2 = o.new_request(n)
    o.run(toks[:2], kv2, slot2)
    snaps2 = list(zip((1, 70), o.states.alloc(2)))
    o.run(toks[2:80], kv2, slot2, prefix_len=2, snapshots=snaps2)
    for p, s in snaps2:
        assert_states_close(o.slot_state(s), o.hf_states_after(toks[: 2 + p]),
                            f"resumed snapshot at {2 + p}")  # fmt: skip
    # Decode snapshot (n = 1).
    (s1,) = o.states.alloc(1)
    o.run([toks[80]], kv2, slot2, prefix_len=80, snapshots=[(1, s1)])
    assert_states_close(o.slot_state(s1), o.hf_states_after(toks[:81]), "decode snapshot")


def check_zeroed_state_changes_logits(o: Oracle, prefix: int = 64, extend: int = 16) -> None:
    """Negative control: resuming from a zeroed state (KV intact) must be far off."""
    toks = o.tokens(prefix + extend, seed=5)
    ref = o.hf_logits(toks)[prefix:]
    kv, slot = o.new_request(prefix + extend)
    o.run(toks[:prefix], kv, slot)
    o.states.clear([slot])
    out = o.run(toks[prefix:], kv, slot, prefix_len=prefix)
    diff = (out - ref).abs().max().item()
    assert diff > 100 * ATOL, f"zeroed state changed logits by only {diff:.3g}"


ORACLE_CHECKS: dict[str, Callable[[Oracle], None]] = {
    "full_prompt": check_full_prompt,
    "resume_1": lambda o: check_resume(o, 1),
    "resume_3": lambda o: check_resume(o, 3),
    "resume_64": lambda o: check_resume(o, 64),
    "resume_256": lambda o: check_resume(o, 256),
    "decode_40": check_decode,
    "mixed_batch": check_mixed_batch,
    "snapshots": check_snapshots,
    "zeroed_state_control": check_zeroed_state_changes_logits,
}


def build_oracle(case: OracleCase, root: Path, dtype: torch.dtype = torch.float32) -> Oracle:
    folder = root / case.name
    if not (folder / "config.json").exists():
        make_tiny_checkpoint(case.arch, str(folder), seed=case.seed, **case.overrides)
    return Oracle(case, folder, dtype=dtype)
