"""The kernel-backend contract (docs/backends.md): every registered backend against the torch
reference, op by op, on one forward's layout that mixes decodes (one with a snapshot) and
prefills of several chunk counts (cached prefixes, two sharing their KV, snapshots inside a
chunk, on a chunk boundary and at the end), at real head shapes, in fp32 and bf16.

Two checks per state op: the backend's outputs and *whole pools* (so a stray write shows) equal
the reference's; and every snapshot slot holds the state after that many tokens, computed
independently by running the same op over the segment cut to that length. A backend that drops
snapshot states fails (negative control).

A second layout has verify steps (``layout.VerifyReq``: decodes of several positions, two of
them sharing a cached prefix, one also copying its last state to a snapshot) beside a plain
decode and prefills: outputs and whole pools against the reference, and each position's slot
against the same op over the request cut to that many positions (after one: a plain one-token
decode). A backend that writes only a verify's last state fails (negative control).

Tolerances: fp32, atol = rtol = 2e-4. bf16: the backend and the reference run on the same
bf16-rounded inputs, and each tensor (output or pool) may differ from the reference's by twice
the largest change that rounding those inputs to bf16 makes to that tensor in the reference
(the reference on the unrounded fp32 draws against the reference on their bf16 roundings,
measured per tensor on this case), plus the fp32 tolerance: 0.5-3 bf16 ulps of each tensor's
largest value (``test_bf16_tolerances_are_a_few_ulps``; 3e-2 before, a 30% error on the ~0.1
states). A kernel whose bf16 path writes a state 5% off fails (negative control). fp32 on a GPU
(the ``cuda`` backend there): fla-core's dots run in TF32, so each tensor may also differ by
``TF32_SLACK`` (4 TF32 units) x its largest value; a 1% state error still fails.

The ``torch`` backend is the reference itself and is not run against it (it could not fail);
its ops are tested against independent computations (naive recurrences and transformers'
layers: ``test_kernels_gdn.py``, ``test_mamba2_kernels.py``, ``test_attention.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import pytest
import torch

from mambaradix.core import ForwardReq
from mambaradix.kernels.backend import backend_names, create_backend
from mambaradix.kernels.gated_delta import gated_delta_decode, gdn_gates
from mambaradix.kernels.mamba2 import process_dt
from mambaradix.kernels.norm import GatedNorm
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layers.moe import experts_forward
from mambaradix.layout import ForwardLayout, VerifyReq

SLOTS = 24
# (prefix_len, new tokens, snapshots as (n, slot)); decodes first, as the scheduler orders them
REQUESTS = [
    (9, 1, [(1, 20)]),
    (40, 1, []),
    (0, 5, [(3, 21)]),
    (40, 70, [(64, 22), (70, 23)]),  # shares its 40 cached KV slots with the next one
    (40, 130, [(1, 18), (100, 19)]),
]
# the same with snapshots only where a backend of snapshot stride 64 writes them (a chunk
# boundary or the segment's end): the planner never asks it for others
REQUESTS_STRIDE_64 = [
    (9, 1, [(1, 20)]),
    (40, 1, []),
    (0, 5, [(5, 21)]),
    (40, 70, [(64, 22), (70, 23)]),
    (40, 130, [(64, 18), (128, 19)]),
]
# verify steps (prefix_len, new tokens, a snapshot after each but the last, True: a VerifyReq)
# beside a plain decode and prefills; the two verifies share their 40 cached KV slots (and
# with the last prefill), the second also copies its state after its last token
REQUESTS_VERIFY = [
    (9, 1, [(1, 20)]),
    (40, 4, [(1, 10), (2, 11), (3, 12)], True),
    (40, 3, [(1, 13), (2, 14), (3, 15)], True),
    (0, 5, [(3, 21)]),
    (40, 70, [(64, 22), (70, 23)]),
]
REQUESTS_VERIFY_STRIDE_64 = [*REQUESTS_VERIFY[:3], (0, 5, [(5, 21)]), REQUESTS_VERIFY[4]]
KV_LEN = 400


@dataclass
class Case:
    dtype: torch.dtype
    atol: float  # fp32: atol = rtol; bf16: the fp32 slack added to the rounding budget
    # fp32 whose dots run in TF32 (fla-core's kernels on a GPU): each tensor may also differ
    # by TF32_SLACK x its largest value
    tf32: bool = False


@dataclass(frozen=True)
class Shapes:
    """Head shapes: Gated DeltaNet (key heads, value heads, Dk, Dv), Mamba2 (heads, P, N),
    attention (query heads, KV heads, D)."""

    gdn: tuple[int, int, int, int]
    mamba2: tuple[int, int, int]
    attention: tuple[int, int, int]


# real head shapes: Qwen3.5's GDN heads of 128, Granite-4.0-H's Mamba2 heads of 64 x state 128,
# 128-dim attention with GQA 4
REAL = Shapes(gdn=(2, 4, 128, 128), mamba2=(8, 64, 128), attention=(8, 2, 128))
# small ones for kernels run by the Triton interpreter (cost grows with every block's size)
SMALL = Shapes(gdn=(2, 4, 32, 32), mamba2=(4, 16, 32), attention=(4, 2, 32))


CASES = {"fp32": Case(torch.float32, 2e-4), "bf16": Case(torch.bfloat16, 2e-4)}
BF16_ROUNDING_FACTOR = 2.0  # x the largest change bf16 rounding of the inputs makes to a tensor
# TF32 keeps 10 mantissa bits (unit roundoff 2^-11); fla-core's fp32 states came out ~1e-3 of
# their largest value off on an H200 (2026-12-04): four units leave twice that
TF32_SLACK = 4 * 2.0**-11
# the backends under contract: every registered one but the reference itself
BACKENDS = [name for name in backend_names() if name != "torch"]


def _layout(requests=REQUESTS, device: str | torch.device = "cpu") -> ForwardLayout:
    shared = torch.arange(40)
    reqs, next_kv = [], 40
    for slot, (prefix, n, snaps, *verify) in enumerate(requests):
        own = torch.arange(next_kv, next_kv + prefix + n)
        next_kv += prefix + n
        kv = torch.cat([shared, own[prefix:]]) if prefix == 40 else own
        kind = VerifyReq if verify else ForwardReq
        reqs.append(kind(prefix, [1] * n, kv, slot, list(snaps), all_logits=bool(verify)))
    return ForwardLayout.build(reqs, device)


def _positions_cut(layout: ForwardLayout, k: int, n: int) -> ForwardLayout:
    """The layout of decode ``k`` (a verify) alone, cut to its first ``n`` positions (after
    one: a plain one-token decode)."""
    r = layout.reqs[layout.decode.reqs[k]]
    snaps = [(m, slot) for m, slot in r.snapshots if m < n]
    cut = VerifyReq(r.prefix_len, r.input_ids[:n], r.kv_slots[: r.prefix_len + n], r.state_slot,
                    snaps)  # fmt: skip
    return ForwardLayout.build([cut])


def _truncated(layout: ForwardLayout, p: int, n: int) -> ForwardLayout:
    """The layout of prefill segment ``p`` alone, cut to its first ``n`` tokens."""
    r = layout.reqs[layout.prefill.reqs[p]]
    cut = ForwardReq(r.prefix_len, r.input_ids[:n], r.kv_slots[: r.prefix_len + n], r.state_slot)
    if n == 1:
        cut.input_ids = cut.input_ids * 2  # a prefill of 2 tokens, the state after the first
        cut.kv_slots = r.kv_slots[: r.prefix_len + 2]
        cut.snapshots = [(1, SLOTS - 1)]
    return ForwardLayout.build([cut])


def _moved(obj, device: torch.device):
    """``obj`` with every tensor in it (lists, tuples, dicts, dataclasses) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: _moved(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _moved(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj


def _rand(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


class _Ops:
    """Random inputs of every op at real head shapes, and how to run each op on a backend."""

    def __init__(self, case: Case, shapes: Shapes = REAL, requests=REQUESTS) -> None:
        g = torch.Generator().manual_seed(0)
        dt = case.dtype
        self.case, self.shapes, self.requests = case, shapes, requests
        self.layout = _layout(requests)
        Tp, Td = self.layout.prefill.num_tokens, self.layout.decode.rows.count
        self.hk, self.hv, self.dk, self.dv = shapes.gdn
        K = 4
        C = 2 * self.hk * self.dk + self.hv * self.dv
        self.gdn = dict(
            conv_pool=_rand(g, SLOTS, C, K - 1, dtype=dt),
            ssm_pool=_rand(g, SLOTS, self.hv, self.dk, self.dv, scale=0.1),
        )
        self.conv_w, self.conv_b = _rand(g, C, K, dtype=dt, scale=0.5), _rand(g, C, dtype=dt)
        self.x_pre = _rand(g, Tp, C, dtype=dt)
        self.x_dec = _rand(g, Td, C, dtype=dt)
        self.ab_pre = [_rand(g, Tp, self.hv, dtype=dt) for _ in "ab"]
        self.ab_dec = [_rand(g, Td, self.hv, dtype=dt) for _ in "ab"]
        self.A_log, self.dt_bias = _rand(g, self.hv, dtype=dt), _rand(g, self.hv, dtype=dt)
        H, P, N = shapes.mamba2  # 1 group
        self.m2 = dict(ssm_pool=_rand(g, SLOTS, H, P, N, scale=0.1))
        self.m2_in = [
            (_rand(g, n, H, P, dtype=dt), _rand(g, n, H), _rand(g, n, 1, N, dtype=dt),
             _rand(g, n, 1, N, dtype=dt)) for n in (Tp, Td)
        ]  # fmt: skip
        self.m2_A, self.m2_D = -torch.rand(H, generator=g) - 0.1, _rand(g, H, dtype=dt)
        self.m2_dt_bias = torch.zeros(H)
        # the fused Mamba2 decode step: xBC and raw dt as views of one projection row
        self.m2_shape = (H, P, 1, N)
        cm = H * P + 2 * N
        self.m2_conv = dict(conv_pool=_rand(g, SLOTS, cm, K - 1, dtype=dt))
        self.m2_conv_w, self.m2_conv_b = (
            _rand(g, cm, K, dtype=dt, scale=0.3),
            _rand(g, cm, dtype=dt),
        )
        self.m2_proj = _rand(g, Td, 16 + cm + H, dtype=dt)
        self.m2_params = (_rand(g, H, dtype=dt, scale=0.5), _rand(g, H, dtype=dt))  # A_log, dt_bias
        hq, hkv, d = shapes.attention
        self.kv = dict(
            k_pool=_rand(g, KV_LEN, hkv, d, dtype=dt), v_pool=_rand(g, KV_LEN, hkv, d, dtype=dt)
        )
        T = self.layout.num_tokens
        self.q, self.k, self.v = (_rand(g, T, h, d, dtype=dt) for h in (hq, hkv, hkv))
        self.scale = d**-0.5
        # the mixers' output norms handed to their decode ops (gate rows, weight)
        g = torch.Generator().manual_seed(2)
        self.gdn_norm = GatedNorm(
            _rand(g, Td, self.hv * self.dv, dtype=dt), (1 + _rand(g, self.dv, scale=0.2)).to(dt),
            1e-6, self.dv,
        )  # fmt: skip
        self.m2_norm = GatedNorm(
            _rand(g, Td, H * P, dtype=dt), (1 + _rand(g, H * P, scale=0.2)).to(dt), 1e-6, H * P
        )
        self.m2_gate = GatedNorm(self.m2_norm.gate, None, 0.0, P)  # no norm: y * silu(gate)

    # each returns (outputs, pools) after running on fresh copies of the pools
    def conv_prefill(self, be, layout=None):
        pools = {"conv_pool": self.gdn["conv_pool"].clone()}
        y = be.conv1d_prefill(self._pre(self.x_pre, layout), self.conv_w, self.conv_b,
                              pools["conv_pool"], layout or self.layout, "silu")  # fmt: skip
        return [y], pools

    def conv_decode(self, be, layout=None):
        pools = {"conv_pool": self.gdn["conv_pool"].clone()}
        y = be.conv1d_decode(self._dec(self.x_dec, layout), self.conv_w, self.conv_b,
                             pools["conv_pool"], layout or self.layout, "silu")  # fmt: skip
        return [y], pools

    def gdn_prefill(self, be, layout=None):
        pools = {"ssm_pool": self.gdn["ssm_pool"].clone()}
        x = self._pre(self.x_pre, layout).float()
        kd = self.hk * self.dk
        q, k, v = x.split([kd, kd, self.hv * self.dv], dim=-1)
        n = x.shape[0]
        a, b = (self._pre(t, layout) for t in self.ab_pre)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        layout = layout or self.layout
        dt = self.case.dtype
        y = be.gdn_prefill(
            q.reshape(n, self.hk, self.dk).to(dt), k.reshape(n, self.hk, self.dk).to(dt),
            v.reshape(n, self.hv, self.dv).to(dt), g, beta.to(dt), pools["ssm_pool"], layout,
        )  # fmt: skip
        return [y], pools

    def gdn_decode(self, be, norm=None, layout=None, beta_scale=1.0):
        pools = {k: v.clone() for k, v in self.gdn.items()}
        y = be.gdn_decode(
            self._dec(self.x_dec, layout), *(self._dec(t, layout) for t in self.ab_dec),
            pools["conv_pool"], pools["ssm_pool"], layout or self.layout, self.conv_w,
            self.conv_b, self.A_log, self.dt_bias, self.hk, "silu", norm, beta_scale,
        )  # fmt: skip
        return [y], pools

    def gdn_decode_norm(self, be):
        return self.gdn_decode(be, self.gdn_norm)

    def gdn_decode_beta2(self, be, layout=None):
        """With the write strength doubled (OLMo-Hybrid)."""
        return self.gdn_decode(be, self.gdn_norm, layout, beta_scale=2.0)

    def mamba2_prefill(self, be, layout=None):
        pools = {"ssm_pool": self.m2["ssm_pool"].clone()}
        x, dt, B, C = (self._pre(t, layout) for t in self.m2_in[0])
        y = be.mamba2_prefill(x, process_dt(dt, self.m2_dt_bias), self.m2_A, B, C, self.m2_D,
                              pools["ssm_pool"], layout or self.layout)  # fmt: skip
        return [y], pools

    def mamba2_decode(self, be, layout=None):
        pools = {"ssm_pool": self.m2["ssm_pool"].clone()}
        x, dt, B, C = (self._dec(t, layout) for t in self.m2_in[1])
        y = be.mamba2_decode(x, process_dt(dt, self.m2_dt_bias), self.m2_A, B, C, self.m2_D,
                             pools["ssm_pool"], layout or self.layout)  # fmt: skip
        return [y], pools

    def mamba2_mixer_decode_norm(self, be):
        return self.mamba2_mixer_decode(be, self.m2_norm)

    def mamba2_mixer_decode_gate(self, be):
        """Without a norm, the bare gate (Falcon-H1)."""
        return self.mamba2_mixer_decode(be, self.m2_gate)

    def mamba2_mixer_decode(self, be, norm=None, layout=None):
        pools = {
            **{k: v.clone() for k, v in self.m2_conv.items()},
            "ssm_pool": self.m2["ssm_pool"].clone(),
        }
        H, P, G, N = self.m2_shape
        proj = self._dec(self.m2_proj, layout)
        xbc = proj[:, 16 : 16 + H * P + 2 * G * N]
        dt_raw = proj[:, 16 + H * P + 2 * G * N :]
        y = be.mamba2_mixer_decode(
            xbc, dt_raw, pools["conv_pool"], pools["ssm_pool"], layout or self.layout,
            self.m2_conv_w,
            self.m2_conv_b, "silu", *self.m2_params, (0.0, float("inf")), self.m2_D, self.m2_shape,
            norm,
        )  # fmt: skip
        return [y], pools

    def attention(self, be):
        pools = {k: v.clone() for k, v in self.kv.items()}
        lay = self.layout
        be.store_kv(self.k, self.v, pools["k_pool"], pools["v_pool"], lay)
        pre, dec = lay.prefill.rows, lay.decode.rows
        yp = be.paged_attention_prefill(pre.take(self.q), *pools.values(), lay, self.scale)
        yd = be.paged_attention_decode(dec.take(self.q), *pools.values(), lay, self.scale)
        return [yp, yd], pools

    def per_token(self, be):
        g = torch.Generator().manual_seed(1)
        dt = self.case.dtype
        x, gate, w = (
            _rand(g, 37, 256, dtype=dt),
            _rand(g, 37, 256, dtype=dt),
            _rand(g, 256, dtype=dt),
        )
        heads = _rand(g, 37, 4, 128, dtype=dt)
        cos, sin = torch.cos(_rand(g, 37, 64)), torch.sin(_rand(g, 37, 64))
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(37)])
        weights = torch.softmax(_rand(g, 37, 2), -1).to(dt)
        gate_up, down = (
            _rand(g, 8, 64, 256, dtype=dt, scale=0.1),
            _rand(g, 8, 256, 32, dtype=dt, scale=0.1),
        )
        # a decode batch's routed experts (5 tokens, 2 of 8 experts each; intermediate 64, the
        # width the cpu backend's C call takes): expert 3 unrouted
        ids5 = torch.tensor([[0, 1], [1, 5], [7, 0], [2, 1], [6, 4]])
        w5 = torch.softmax(_rand(g, 5, 2), -1).to(dt)
        gu5, down5 = (
            _rand(g, 8, 128, 256, dtype=dt, scale=0.1),
            _rand(g, 8, 256, 64, dtype=dt, scale=0.1),
        )
        x, gate, w, heads, cos, sin, ids, weights, gate_up, down, ids5, w5, gu5, down5 = _moved(
            [x, gate, w, heads, cos, sin, ids, weights, gate_up, down, ids5, w5, gu5, down5],
            self.device,
        )
        outs = [
            be.rms_norm(x, w, 1e-6, False),
            be.rms_norm(x, w, 1e-6, True),
            *be.add_rms_norm(x, gate, w, 1e-6, False, 0.5),
            *be.add_rms_norm(x, gate, w, 1e-6, True),
            be.rms_norm_gated(x, gate, w, 1e-6),
            be.rms_norm_rope(heads, w[:128], 1e-6, True, cos, sin),
            experts_forward(x, weights, ids, gate_up, down, "silu", be),
            experts_forward(x[:5], w5, ids5, gu5, down5, "silu", be),
        ]
        return outs, {}

    device = torch.device("cpu")

    def on(self, device: str | torch.device) -> _Ops:
        """These inputs on ``device`` (the layout rebuilt there); themselves on the CPU."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        other = copy.copy(self)
        for name, value in vars(self).items():
            setattr(other, name, _moved(value, device))
        other.layout = _layout(self.requests, device)
        other.device = device
        return other

    def _pre(self, t: torch.Tensor, layout: ForwardLayout | None) -> torch.Tensor:
        """Prefill inputs of ``layout`` (a truncated one reads the first rows of its segment)."""
        if layout is None or layout is self.layout:
            return t
        r = layout.reqs[0]
        p = [self.layout.reqs[i].state_slot for i in self.layout.prefill.reqs].index(r.state_slot)
        start = self.layout.prefill.cu_list[p]
        return t[start : start + layout.prefill.num_tokens]

    def _dec(self, t: torch.Tensor, layout: ForwardLayout | None) -> torch.Tensor:
        """Decode inputs of ``layout`` (a cut verify reads the first rows of its request)."""
        if layout is None or layout is self.layout:
            return t
        dec = self.layout.decode
        slot = layout.reqs[0].state_slot
        k = [self.layout.reqs[i].state_slot for i in dec.reqs].index(slot)
        start = sum(dec.widths[:k])
        return t[start : start + layout.decode.rows.count]


STATE_OPS = ["conv_prefill", "conv_decode", "gdn_prefill", "gdn_decode", "gdn_decode_norm",
             "gdn_decode_beta2", "mamba2_prefill", "mamba2_decode", "mamba2_mixer_decode",
             "mamba2_mixer_decode_norm", "mamba2_mixer_decode_gate", "attention",
             "per_token"]  # fmt: skip
PREFILL_OPS = {"conv_prefill": "conv_pool", "gdn_prefill": "ssm_pool", "mamba2_prefill": "ssm_pool"}


def _tensors(ops: _Ops, name: str, backend) -> dict[str, torch.Tensor]:
    """Op ``name``'s outputs (``output i``) and pools (by key) on ``backend``."""
    outs, pools = getattr(ops, name)(backend)
    return {**{f"output {i}": y for i, y in enumerate(outs)}, **pools}


def _max_abs(t: torch.Tensor) -> float:
    return float(t.double().abs().max()) if t.numel() else 0.0


_REFERENCE: dict[tuple, dict[str, dict[str, torch.Tensor]]] = {}


def reference_tensors(
    case: Case, shapes: Shapes = REAL, requests=REQUESTS
) -> dict[str, dict[str, torch.Tensor]]:
    """Per op of ``STATE_OPS``, its ``_tensors`` on the torch reference. The inputs are seeded,
    so they are a function of (case, shapes, requests): computed once a session and shared by
    every test comparing against them (read only)."""
    key = (case.dtype, case.atol, shapes, repr(requests))
    if key not in _REFERENCE:
        ops, ref = _Ops(case, shapes, requests), TorchBackend()
        _REFERENCE[key] = {name: _tensors(ops, name, ref) for name in STATE_OPS}
    return _REFERENCE[key]


def bf16_tolerances(
    case: Case, shapes: Shapes = REAL, requests=REQUESTS
) -> dict[tuple[str, str], float]:
    """Per (op, tensor): the absolute tolerance of the bf16 case, ``BF16_ROUNDING_FACTOR`` x the
    largest change rounding the inputs to bf16 makes to that tensor in the reference, plus
    ``case.atol`` x its largest value."""
    exact_case = Case(torch.float32, case.atol)
    rounded = reference_tensors(case, shapes, requests)
    exact = reference_tensors(exact_case, shapes, requests)
    tol = {}
    for name in STATE_OPS:
        got, want = rounded[name], exact[name]
        for key, t in got.items():
            change = _max_abs(t.double() - want[key].double())
            tol[name, key] = BF16_ROUNDING_FACTOR * change + case.atol * _max_abs(t)
    return tol


def contract_failures(
    backend, case: Case, shapes: Shapes = REAL, requests=REQUESTS, device: str = "cpu"
) -> list[str]:
    """Every way ``backend`` departs from the contract on this case (empty: it passes): the
    backend runs the inputs on ``device``, the reference on the CPU."""
    ops, ref = _Ops(case, shapes, requests), TorchBackend()
    on_device = ops.on(device)
    tol = bf16_tolerances(case, shapes, requests) if case.dtype == torch.bfloat16 else None
    reference = reference_tensors(case, shapes, requests)
    failures = []

    def close(a: torch.Tensor, b: torch.Tensor, name: str, key: str) -> bool:
        a = a.cpu()
        if a.shape != b.shape:
            return False
        if tol is None:
            atol = max(case.atol, TF32_SLACK * _max_abs(b)) if case.tf32 else case.atol
            return torch.allclose(a.float(), b.float(), atol=atol, rtol=case.atol)
        return _max_abs(a.double() - b.double()) <= tol[name, key]

    # each op runs once on the backend; every check below reads these outputs and pools
    ran = {name: _tensors(on_device, name, backend) for name in STATE_OPS}
    for name in STATE_OPS:
        got, want = ran[name], reference[name]
        for key in want:
            if not close(got[key], want[key], name, key):
                failures.append(f"{name}: {key} differs from the reference")
    # snapshots: the state after n tokens, from the same op over the segment cut to n tokens
    seg = ops.layout.prefill
    for name, key in PREFILL_OPS.items():
        pools = ran[name]
        for p, n, slot in zip(seg.snapshot_seqs, seg.snapshot_offsets, seg.snapshot_slots.tolist()):
            cut = _truncated(ops.layout, p, n)
            _, alone = getattr(ops, name)(ref, cut)
            where = cut.prefill.snapshot_slots[0] if n == 1 else cut.prefill.state_slots[0]
            if not close(pools[key][slot], alone[key][where], name, key):
                failures.append(f"{name}: snapshot after {n} tokens of segment {p} is wrong")
    dec = ops.layout.decode
    for name, key in (
        ("conv_decode", "conv_pool"),
        ("gdn_decode", "ssm_pool"),
        ("mamba2_decode", "ssm_pool"),
        ("gdn_decode_norm", "ssm_pool"),
        ("gdn_decode_beta2", "ssm_pool"),
        ("mamba2_mixer_decode", "conv_pool"),
        ("mamba2_mixer_decode", "ssm_pool"),
        ("mamba2_mixer_decode_norm", "ssm_pool"),
    ):
        pools = ran[name]
        for src, dst in zip(dec.snapshot_src.tolist(), dec.snapshot_slots.tolist()):
            if not torch.equal(pools[key][dst], pools[key][src]):
                failures.append(f"{name}: a decode's snapshot is not its state after its token")
    # decodes of several positions: each position's slot holds the state after that many
    # positions, from the same op over the request cut to them (the reference)
    if dec.multi:
        row_slots = dec.row_slots.tolist()
        for name, key in (
            ("conv_decode", "conv_pool"),
            ("gdn_decode", "conv_pool"),
            ("gdn_decode", "ssm_pool"),
            ("mamba2_decode", "ssm_pool"),
            ("mamba2_mixer_decode", "conv_pool"),
            ("mamba2_mixer_decode", "ssm_pool"),
        ):
            pools = ran[name]
            for k, w in enumerate(dec.widths):
                first = sum(dec.widths[:k])
                for n in range(1, w):
                    cut = _positions_cut(ops.layout, k, n)
                    _, alone = getattr(ops, name)(ref, layout=cut)
                    got = pools[key][row_slots[first + n - 1]]
                    if not close(got, alone[key][cut.reqs[0].state_slot], name, key):
                        failures.append(f"{name}: {key} after {n} positions of decode {k} is wrong")
    return failures


def _case(case: str, device: str) -> Case:
    """The case as a backend on ``device`` runs it: fp32 on a GPU is TF32 in fla-core's dots
    (not emulated by the interpreter, which computes fp32 on the CPU)."""
    if device == "cuda" and CASES[case].dtype == torch.float32:
        return dataclasses.replace(CASES[case], tf32=True)
    return CASES[case]


def _runs(name: str) -> tuple[str, str]:
    """Where backend ``name``'s kernels run in this test: its device, and ``interpreted``
    when its Triton kernels run on the CPU under the interpreter (tests/triton)."""
    if name != "cuda":
        return "cpu", ""
    return ("cuda", "") if torch.cuda.is_available() else ("cpu", "interpreted")


LAYOUTS = {  # the layouts of the contract, by the snapshot stride a backend declares
    "mixed": {1: REQUESTS, 64: REQUESTS_STRIDE_64},
    "verify": {1: REQUESTS_VERIFY, 64: REQUESTS_VERIFY_STRIDE_64},
}


def _requests(backend, layout: str = "mixed") -> list:
    stride = backend.capabilities.snapshot_stride
    assert stride in (1, 64), stride  # the cases below cover these
    return LAYOUTS[layout][stride]


def _contract(name: str, case: str, shapes: Shapes, layout: str = "mixed") -> list[str]:
    backend = create_backend(name)
    device, _ = _runs(name)
    return contract_failures(
        backend, _case(case, device), shapes, _requests(backend, layout), device
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_passes_the_contract(name: str, case: str, layout: str) -> None:
    """At real head shapes; a backend whose kernels are interpreted here runs small ones
    (``test_backend_passes_the_contract_at_real_shapes`` is its slow test)."""
    interpreted = _runs(name)[1]
    assert _contract(name, case, SMALL if interpreted else REAL, layout) == []


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES), ids=str)
@pytest.mark.parametrize("name", [n for n in BACKENDS if _runs(n)[1]])
def test_backend_passes_the_contract_at_real_shapes(name: str, case: str, layout: str) -> None:
    assert _contract(name, case, REAL, layout) == []


def test_bf16_tolerances_are_a_few_ulps() -> None:
    """The derived bf16 tolerances stay within 4 bf16 ulps of each tensor's largest value (the
    bf16 spacing there), and each tensor's rounding budget is not zero (every one depends on
    a bf16 input)."""
    case = CASES["bf16"]
    reference = reference_tensors(case)
    for (name, key), tol in bf16_tolerances(case).items():
        top = _max_abs(reference[name][key])
        ulp = 2.0 ** (torch.tensor(top).log2().floor().item() - 7)
        assert case.atol * top < tol <= 4 * ulp, (name, key, tol, ulp)


class _Bf16StateError(TorchBackend):
    """A kernel whose bf16 path writes the states of one op 5% too large (fp32 exact): the
    Gated DeltaNet decode step's (states ~0.1-1) or the Mamba2 prefill's final ones (~1-20)."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def gated_delta_step(self, x, conv_pool, ssm_pool, slots, *args, **kw):
        out = gated_delta_decode(x, conv_pool, ssm_pool, slots, *args, **kw)
        if self.op == "gdn_decode" and x.dtype == torch.bfloat16:
            ssm_pool[slots] *= 1.05
        return out

    def mamba2_prefill(self, x, dt, A, B, C, D, ssm_pool, layout):
        out = super().mamba2_prefill(x, dt, A, B, C, D, ssm_pool, layout)
        if self.op == "mamba2_prefill" and x.dtype == torch.bfloat16:
            ssm_pool[layout.prefill.state_slots] *= 1.05
        return out


@pytest.mark.parametrize("op", ["gdn_decode", "mamba2_prefill"])
def test_a_bf16_only_state_error_of_5_percent_fails_the_contract(op: str) -> None:
    assert contract_failures(_Bf16StateError(op), CASES["fp32"]) == []
    failures = contract_failures(_Bf16StateError(op), CASES["bf16"])
    want = {
        "gdn_decode": ["gdn_decode", "gdn_decode_norm", "gdn_decode_beta2"],
        "mamba2_prefill": ["mamba2_prefill"],
    }
    assert failures == [f"{name}: ssm_pool differs from the reference" for name in want[op]]


class _Fp32StateScale(TorchBackend):
    """The Gated DeltaNet decode step's fp32 states scaled by ``factor`` after the step."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def gated_delta_step(self, x, conv_pool, ssm_pool, slots, *args, **kw):
        out = gated_delta_decode(x, conv_pool, ssm_pool, slots, *args, **kw)
        ssm_pool[slots] *= self.factor
        return out


def test_the_tf32_slack_still_catches_a_state_error_of_1_percent() -> None:
    """The GPU's fp32 tolerance (``TF32_SLACK``) passes a 0.05% state error, which the plain
    fp32 tolerance fails (the slack is in use), and fails 1% and dropped snapshots."""
    tf32 = dataclasses.replace(CASES["fp32"], tf32=True)
    small = [f for f in contract_failures(_Fp32StateScale(1.0005), CASES["fp32"]) if "ssm" in f]
    assert small, "a 0.05% error passes the fp32 tolerance: the slack below is not tested"
    assert contract_failures(_Fp32StateScale(1.0005), tf32) == []
    failures = contract_failures(_Fp32StateScale(1.01), tf32)
    assert "gdn_decode: ssm_pool differs from the reference" in failures, failures
    failures = contract_failures(_DropsSnapshots(), tf32)
    assert any("gdn_prefill: snapshot" in f for f in failures), failures


class _DropsSnapshots(TorchBackend):
    """Writes final states but loses every snapshot (the bug the contract must catch)."""

    def gdn_prefill(self, q, k, v, g, beta, ssm_pool, layout):
        before = ssm_pool.clone()
        out = super().gdn_prefill(q, k, v, g, beta, ssm_pool, layout)
        _restore(ssm_pool, before, layout.prefill.snapshot_slots)
        return out

    def mamba2_prefill(self, x, dt, A, B, C, D, ssm_pool, layout):
        before = ssm_pool.clone()
        out = super().mamba2_prefill(x, dt, A, B, C, D, ssm_pool, layout)
        _restore(ssm_pool, before, layout.prefill.snapshot_slots)
        return out


def _restore(pool: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> None:
    pool[slots] = before[slots]


class _IgnoresNorms(TorchBackend):
    """Accepts the mixers' output norm but returns the decode step's output without it."""

    def gdn_decode(self, *args, norm=None, beta_scale=1.0):
        return super().gdn_decode(*args[:12], beta_scale=args[13] if len(args) > 13 else 1.0)

    def mamba2_mixer_decode(self, *args, norm=None):
        return super().mamba2_mixer_decode(*args[:13])


def test_a_backend_that_ignores_the_output_norm_fails_the_contract() -> None:
    failures = contract_failures(_IgnoresNorms(), CASES["bf16"])
    assert "gdn_decode_norm: output 0 differs from the reference" in failures, failures
    assert "mamba2_mixer_decode_norm: output 0 differs from the reference" in failures, failures
    assert "mamba2_mixer_decode_gate: output 0 differs from the reference" in failures, failures
    assert not any(f.startswith(("gdn_decode:", "mamba2_mixer_decode:")) for f in failures)


class _IgnoresBetaScale(TorchBackend):
    """Accepts Gated DeltaNet's beta scale but steps with beta = sigmoid(b)."""

    def gdn_decode(self, *args, norm=None, beta_scale=1.0):
        return super().gdn_decode(*args[:13])


def test_a_backend_that_ignores_the_beta_scale_fails_the_contract() -> None:
    failures = contract_failures(_IgnoresBetaScale(), CASES["fp32"])
    assert "gdn_decode_beta2: output 0 differs from the reference" in failures, failures
    assert not any(f.startswith(("gdn_decode:", "gdn_decode_norm:")) for f in failures)


def test_a_backend_that_drops_snapshots_fails_the_contract() -> None:
    failures = contract_failures(_DropsSnapshots(), CASES["fp32"])
    assert any("gdn_prefill: snapshot" in f for f in failures), failures
    assert any("mamba2_prefill: snapshot" in f for f in failures), failures
    assert any("ssm_pool differs" in f for f in failures), failures


def _cuda_backend_rolling(part: str, name: str, device: str):
    """A cuda backend whose per-forward index tensor ``CudaIndex.<part>.<name>`` is rolled by
    one (each segment or row given its neighbour's), its kernels otherwise unchanged."""
    from mambaradix.kernels.cuda_backend import CudaBackend

    class Rolled(CudaBackend):
        def prepare(self, layout):
            super().prepare(layout)
            idx = getattr(layout.meta, part)
            setattr(idx, name, getattr(idx, name).roll(1))

    return Rolled(device)


def test_a_cuda_backend_fed_the_wrong_state_slot_fails_the_contract() -> None:
    """Negative control for the Triton kernels: the prefill ops read and write each segment's
    neighbour's slot (its kernels otherwise unchanged)."""
    device, _ = _runs("cuda")
    for chunked in (False, True):  # both forms of the Mamba2 prefill
        backend = _cuda_backend_rolling("prefill", "state_slots", device)
        backend.mamba2_chunked = chunked
        failures = contract_failures(backend, _case("fp32", device), SMALL, REQUESTS_STRIDE_64,
                                     device)  # fmt: skip
        assert any(f.startswith("conv_prefill: conv_pool") for f in failures), failures
        assert any(f.startswith("mamba2_prefill: ssm_pool") for f in failures), failures


def test_a_cuda_backend_whose_verify_rows_write_the_wrong_slots_fails_the_contract() -> None:
    """Negative control for the multi-position decode kernels: each verify row's state goes
    into its neighbour row's slot (the kernels otherwise unchanged)."""
    device, _ = _runs("cuda")
    backend = _cuda_backend_rolling("decode", "row_slots", device)
    failures = contract_failures(backend, _case("fp32", device), SMALL,
                                 REQUESTS_VERIFY_STRIDE_64, device)  # fmt: skip
    for op, pool in (("conv_decode", "conv_pool"), ("gdn_decode", "ssm_pool"),
                     ("mamba2_decode", "ssm_pool")):  # fmt: skip
        assert any(f.startswith(f"{op}: {pool}") for f in failures), (op, failures)


@pytest.mark.parametrize("case", list(CASES), ids=str)
def test_the_cuda_backends_chunked_mamba2_prefill_passes_the_contract(case: str) -> None:
    """The fully parallel Mamba2 prefill (``mamba2_prefill_chunked``), which the backend picks
    for few long segments (``prefers_chunked``; the contract's own segments take the sequential
    kernel), forced on every prefill."""
    from mambaradix.kernels.cuda_backend import CudaBackend

    device, _ = _runs("cuda")
    backend = CudaBackend(device)
    backend.mamba2_chunked = True
    assert contract_failures(backend, _case(case, device), SMALL, REQUESTS_STRIDE_64,
                             device) == []  # fmt: skip


class _LastPositionOnly(TorchBackend):
    """Steps a verify's positions but keeps only its last state: every other position's slot
    is left as it was (a multi-position kernel that writes only the working slot)."""

    def _stepwise(self, layout, pools, rows, step):
        dec = layout.decode
        kept = dec.row_slots[dec.row_slots != dec.state_slots.repeat_interleave(
            torch.tensor(dec.widths))]  # fmt: skip
        before = [pool[kept].clone() for pool in pools]
        out = super()._stepwise(layout, pools, rows, step)
        for pool, b in zip(pools, before):
            pool[kept] = b
        return out


def test_a_backend_that_keeps_only_a_verifys_last_state_fails_the_contract() -> None:
    failures = contract_failures(_LastPositionOnly(), CASES["fp32"], REAL, REQUESTS_VERIFY)
    for name, key in (
        ("conv_decode", "conv_pool"),
        ("gdn_decode", "ssm_pool"),
        ("mamba2_decode", "ssm_pool"),
        ("mamba2_mixer_decode", "ssm_pool"),
    ):
        assert f"{name}: {key} differs from the reference" in failures, failures
        assert f"{name}: {key} after 1 positions of decode 1 is wrong" in failures, failures
    # the outputs are right: each position's state is computed, then lost
    assert not any("output" in f for f in failures), failures
    # on the plain layout nothing changes
    assert contract_failures(_LastPositionOnly(), CASES["fp32"]) == []
