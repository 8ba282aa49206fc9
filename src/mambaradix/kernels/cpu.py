"""Native C kernels (``kernels.native``) for the decode hot spots, as the primitives of the
``"cpu"`` backend (``kernels.cpu_backend``).

Each function has the signature of the torch reference it replaces and falls back to it for
inputs the C code does not cover (another device or dtype, an unusual layout, or no compiler
here), so the backend can always be active on CPU. Each fallback is logged once per operation
and input dtypes (the warm-up runs every path at engine start, so the start-up log names them).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mambaradix.kernels import (
    attention,
    attention_plan,
    bf16_matmul,
    fp8,
    gated_delta,
    moe,
    native,
    norm,
    rope,
)
from mambaradix.layout import PrefillSegments

logger = logging.getLogger(__name__)

_SILU = {"silu": 1, "swish": 1, None: 0, "identity": 0}
_REPORTED: set[tuple] = set()


def _fallback(name: str, *tensors: torch.Tensor) -> None:
    """Say once per (operation, input dtypes) that the torch reference runs instead."""
    key = (name, *(t.dtype for t in tensors))
    if key not in _REPORTED:
        _REPORTED.add(key)
        logger.warning(
            "kernel %s: no native code for these inputs (%s, %s): the torch reference runs",
            name,
            "/".join(str(t.dtype).removeprefix("torch.") for t in tensors),
            "cpu" if all(t.device.type == "cpu" for t in tensors) else "not on the CPU",
        )


_VARIANTS = {torch.float32: "", torch.bfloat16: "_bf16"}  # C variant by data dtype


def _native_fn(lib, name: str, dtype: torch.dtype):
    """The C function of ``name`` for ``dtype`` data, or None (the caller falls back)."""
    suffix = _VARIANTS.get(dtype)
    return None if lib is None or suffix is None else getattr(lib, name + suffix)


_DENSE = torch.contiguous_format  # (empty_like(t, memory_format=_DENSE): 2 us, empty(shape): 4)


def _cpu_dense(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.is_cpu and t.dtype == dtype and t.is_contiguous()


def _cpu_rows(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A CPU matrix of ``dtype`` whose last dim is dense (rows may be strided)."""
    return t.is_cpu and t.dtype == dtype and t.dim() == 2 and t.stride(1) == 1


def _positions(cu: torch.Tensor | None, row_slots: torch.Tensor | None) -> tuple:
    """A decode kernel's position arguments (``csrc/decode.h``): ``cu`` [B+1] and ``row_slots``
    [rows] of decodes of several positions (a verify step), or two NULLs (one row a request,
    its state updated in place)."""
    if cu is None:
        return None, None
    return cu.data_ptr(), row_slots.data_ptr()


def _positions_fit(cu: torch.Tensor | None, row_slots: torch.Tensor | None, rows: int) -> bool:
    """Whether the position arguments are the kernels' (shapes only: a recorded step must not
    read a tensor's values)."""
    return cu is None or (
        _cpu_dense(cu, torch.int64)
        and row_slots is not None
        and _cpu_dense(row_slots, torch.int64)
        and row_slots.numel() == rows
    )


def gated_delta_decode(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    activation: str | None = "silu",
    use_qk_l2norm: bool = True,
    out_norm: norm.GatedNorm | None = None,
    cu: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
    beta_scale: float = 1.0,
) -> torch.Tensor | None:
    """``kernels.gated_delta.gated_delta_decode`` in one pass per request (C, in place), the
    gates included: fp32 throughout, or the model's tensors in bf16 with an fp32 delta state.
    With ``out_norm``, the layer's output norm of each head too (``rms_norm_gated``).
    ``cu`` / ``row_slots``: decodes of several positions (``layout.DecodeRows``: ``x`` holds
    every row, ``slots`` one working slot a request), each position's state into its row's
    slot; None where the C code does not cover those inputs (the caller steps the positions)."""
    dt = x.dtype
    fn = _native_fn(native.load("gated_delta_decode"), "gated_delta_decode", dt)
    fits = (
        fn is not None
        and activation in _SILU
        and all(_cpu_rows(t, dt) for t in (x, a, b))
        and all(_cpu_dense(t, dt) for t in (conv_pool, weight, A_log, dt_bias))
        and _cpu_dense(ssm_pool, torch.float32)
        and (bias is None or _cpu_dense(bias, dt))
        and slots.is_cpu
        and _positions_fit(cu, row_slots, x.shape[0])
    )
    if not fits:
        _fallback("gated_delta_decode", x, conv_pool, ssm_pool, weight, A_log)
        if cu is not None:
            return None
        out = gated_delta.gated_delta_decode(
            x, conv_pool, ssm_pool, slots, weight, bias, a, b, A_log, dt_bias, num_k_heads,
            activation, use_qk_l2norm, beta_scale,
        )  # fmt: skip
        return out if out_norm is None else _gdn_norm(out, out_norm)
    B = x.shape[0]
    hv, dk, dv = ssm_pool.shape[1:]
    fold = (
        out_norm is not None and out_norm.group_size == dv and _folds(out_norm, dt, B, hv * dv, dv)
    )
    conv_dim, width = 2 * num_k_heads * dk + hv * dv, weight.shape[1]
    if x.shape[1] != conv_dim or tuple(conv_pool.shape[1:]) != (conv_dim, width - 1):
        raise ValueError(
            f"gated_delta_decode: x {tuple(x.shape)} / conv pool {tuple(conv_pool.shape)} do not "
            f"match {num_k_heads} key heads and a state of {(hv, dk, dv)} (conv dim {conv_dim})"
        )
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty(B, hv, dv, dtype=dt)
    fn(
        slots.shape[0], slots.data_ptr(), *_positions(cu, row_slots),
        x.data_ptr(), x.stride(0),
        conv_pool.data_ptr(), ssm_pool.data_ptr(),
        weight.data_ptr(), None if bias is None else bias.data_ptr(),
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0),
        A_log.data_ptr(), dt_bias.data_ptr(),
        out.data_ptr(),
        num_k_heads, hv, dk, dv, width,
        _SILU[activation], int(use_qk_l2norm),
        *_norm_args(out_norm if fold else None), beta_scale,
    )  # fmt: skip
    return out if out_norm is None or fold else _gdn_norm(out, out_norm)


def _folds(gn: norm.GatedNorm, dt: torch.dtype, rows: int, features: int, weights: int) -> bool:
    """Whether a decode kernel can finish with ``gn`` (else the norm op runs after it)."""
    g, w = gn.gate, gn.weight
    return (
        _cpu_rows(g, dt)
        and tuple(g.shape) == (rows, features)
        and (w is None or (_cpu_dense(w, dt) and w.numel() == weights))
    )


def _norm_args(gn: norm.GatedNorm | None) -> tuple:
    """A decode kernel's trailing norm arguments: gate, its row stride, weight, eps."""
    if gn is None:
        return None, 0, None, 0.0
    weight = None if gn.weight is None else gn.weight.data_ptr()
    return gn.gate.data_ptr(), gn.gate.stride(0), weight, gn.eps


def _gdn_norm(out: torch.Tensor, gn: norm.GatedNorm) -> torch.Tensor:
    return rms_norm_gated(out, gn.gate.reshape(out.shape), gn.weight, gn.eps)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    """``kernels.norm.rms_norm`` in one C pass per row (fp32 or bf16 data, fp32 sums)."""
    fn = _native_fn(native.load("rms_norm"), "rms_norm", x.dtype)
    rows = None
    if fn is not None and x.is_cpu and x.numel():
        try:
            rows = x.view(-1, x.shape[-1])  # a view: leading dims must merge
        except RuntimeError:
            rows = None
    if rows is None or rows.stride(1) != 1 or not _cpu_dense(weight, x.dtype):
        _fallback("rms_norm", x, weight)
        return norm.rms_norm(x, weight, eps, zero_centered)
    out = torch.empty_like(rows, memory_format=_DENSE)
    fn(
        rows.shape[0], rows.shape[1], rows.data_ptr(), rows.stride(0),
        weight.data_ptr(), eps, int(zero_centered), out.data_ptr(),
    )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.norm.add_rms_norm`` (a residual add, then its norm) in one C pass per row."""
    fn = _native_fn(native.load("rms_norm"), "add_rms_norm", x.dtype)
    k = x.shape[-1]
    fits = (
        fn is not None
        and x.dim() == 2
        and x.shape == residual.shape
        and _cpu_rows(x, x.dtype)
        and _cpu_rows(residual, x.dtype)
        and _cpu_dense(weight, x.dtype)
        and weight.shape == (k,)
    )
    if not fits:
        _fallback("add_rms_norm", x, residual, weight)
        return norm.add_rms_norm(x, residual, weight, eps, zero_centered, scale)
    h, out = (torch.empty_like(x, memory_format=_DENSE) for _ in "ho")
    fn(
        x.shape[0], k, x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
        scale, int(scale != 1.0), weight.data_ptr(), eps, int(zero_centered), h.data_ptr(),
        out.data_ptr(),
    )  # fmt: skip
    return h, out


def rms_norm_gated(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``kernels.norm.rms_norm_gated``: silu in torch (vectorised, fp32 as the reference), the
    rest in one C pass per row."""
    fn = _native_fn(native.load("rms_norm"), "rms_norm_gated", x.dtype)
    rows = gates = None
    fits = fn is not None and x.dtype == gate.dtype and x.numel()
    if fits and x.is_cpu and x.shape == gate.shape and _cpu_dense(weight, x.dtype):
        try:  # views: leading dims must merge
            rows = x.view(-1, x.shape[-1])
            gates = F.silu(gate.reshape(-1, x.shape[-1]).float())  # a copy if strided or bf16
        except RuntimeError:
            rows = None
    if rows is None or rows.stride(1) != 1 or gates.stride(1) != 1:
        _fallback("rms_norm_gated", x, gate, weight)
        return norm.rms_norm_gated(x, gate, weight, eps)
    out = torch.empty_like(rows, memory_format=_DENSE)
    fn(
        rows.shape[0], rows.shape[1], rows.data_ptr(), rows.stride(0),
        gates.data_ptr(), gates.stride(0), weight.data_ptr(), eps, out.data_ptr(),
    )  # fmt: skip
    return out.view(x.shape)


def rms_norm_gate_first(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """``kernels.norm.rms_norm_gate_first``: silu in torch (fp32, as the reference), the
    product, the per-group norm and the weight in one C pass per group."""
    fn = _native_fn(native.load("rms_norm"), "rms_norm_gate_first", x.dtype)
    dim = x.shape[-1]
    rows = gates = None
    fits = fn is not None and x.dtype == gate.dtype and x.numel() and x.shape == gate.shape
    if fits and x.is_cpu and group_size > 0 and dim % group_size == 0:
        if _cpu_dense(weight, x.dtype) and weight.numel() == dim:
            try:  # views: leading dims must merge
                rows = x.view(-1, dim)
                gates = F.silu(gate.reshape(-1, dim).float())  # a copy if strided or bf16
            except RuntimeError:
                rows = None
    if rows is None or rows.stride(1) != 1 or gates.stride(1) != 1:
        _fallback("rms_norm_gate_first", x, gate, weight)
        return norm.rms_norm_gate_first(x, gate, weight, eps, group_size)
    out = torch.empty_like(rows, memory_format=_DENSE)
    fn(
        rows.shape[0], group_size, dim // group_size, rows.data_ptr(), rows.stride(0),
        gates.data_ptr(), gates.stride(0), weight.data_ptr(), eps, out.data_ptr(),
    )  # fmt: skip
    return out.view(x.shape)


def attention_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: attention_plan.DecodePlan | None = None,
    row_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.attention.attention_decode`` with each request's own keys read in place from
    the pools (C, no gather) and merged there with its shared piece, which stays a flash call
    per piece (``attention.attend_shared``). ``row_groups`` (int64 ``[G + 1]``, row offsets):
    groups of consecutive rows that read their keys together, each row's own keys the first of
    its group's longest row (rows of one request in a verify step, with the same ``begin``:
    ``verify_row_groups``); None: each row alone. The result is the same either way."""
    dt = k_pool.dtype
    fn = _native_fn(native.load("attention_decode"), "attention_decode", dt)
    fits = (
        fn is not None
        and q.dtype == dt
        and q.is_cpu
        and _cpu_dense(k_pool, dt)
        and _cpu_dense(v_pool, dt)
        and slot_table.is_cpu
        and slot_table.dtype == torch.int64
        and slot_table.stride(1) == 1
        and q.shape[-1] % 8 == 0
        and v_pool.shape[-1] % 8 == 0
    )
    if not fits:
        _fallback("attention_decode", q, k_pool, v_pool)
        return attention.attention_decode(q, k_pool, v_pool, slot_table, seq_lens, scale, plan)
    B, Hq, D = q.shape
    Hkv, Dv = k_pool.shape[1], v_pool.shape[-1]
    if plan is None:
        plan = attention_plan.decode_plan(slot_table, seq_lens, Hkv)
    ends = seq_lens.to(torch.int64).contiguous()  # (no longer than the table: decode_plan)
    shared = attention.attend_shared(q.contiguous(), k_pool, v_pool, plan, scale)
    so, sl = (None, None) if shared is None else (shared[0].float(), shared[1].float())
    so, sl = (None, None) if so is None else (so.contiguous(), sl.contiguous())
    qf = q.float().contiguous()  # the kernel reads q (and the shared piece) in fp32
    out = torch.empty(B, Hq, Dv, dtype=torch.float32)
    fn(
        B, Hq, Hkv, D, Dv,
        qf.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
        slot_table.data_ptr(), slot_table.stride(0),
        plan.begin.data_ptr(), ends.data_ptr(),
        None if so is None else so.data_ptr(),
        None if sl is None else sl.data_ptr(),
        None if so is None else plan.shared_row.data_ptr(),
        None if row_groups is None else row_groups.data_ptr(),
        0 if row_groups is None else row_groups.numel() - 1,
        scale, out.data_ptr(),
    )  # fmt: skip
    return out if dt == torch.float32 else out.to(dt)


def verify_row_groups(
    cu: torch.Tensor, kv_table: torch.Tensor, seq_lens: torch.Tensor, begin: torch.Tensor
) -> torch.Tensor | None:
    """``attention_decode``'s ``row_groups`` for decodes of several positions (``cu`` [D+1]:
    each request's rows): a request's rows, when they begin their own keys at one place and
    each one's keys are those of the request's last row up to its own length (as a verify step
    lays them out); None when some request's rows do not (each row then reads alone)."""
    if cu.numel() < 2:
        return None
    counts = cu[1:] - cu[:-1]
    last = torch.repeat_interleave(cu[1:] - 1, counts)  # each row's request's last row
    if not bool((begin == begin[last]).all()) or not bool((seq_lens <= seq_lens[last]).all()):
        return None
    cols = torch.arange(kv_table.shape[1])[None, :]
    mine = (cols >= begin[:, None]) & (cols < seq_lens[:, None])
    if not bool(((kv_table == kv_table[last]) | ~mine).all()):
        return None
    return cu.to(torch.int64).contiguous()


@dataclass(slots=True, frozen=True)
class PrefillKeys:
    """A forward's prefill requests as ``attention_prefill`` takes them, built once per forward
    and shared by every attention layer: int64 token offsets ``cu`` [P+1], cached prefix
    lengths [P], and every request's KV slots (prefix and new tokens) concatenated, request p's
    at ``kv_cu[p] .. kv_cu[p+1]``. ``buffers``: the kernel's gather buffers by (KV heads, key
    and value head sizes), allocated by the first layer that needs them and reused by the
    others."""

    cu: torch.Tensor
    prefix: torch.Tensor
    kv_cu: torch.Tensor
    slots: torch.Tensor
    longest: int  # keys of the longest request
    buffers: dict = field(default_factory=dict)

    @classmethod
    def of(cls, seg: PrefillSegments) -> PrefillKeys:
        long = torch.int64
        lens = [0]
        for s in seg.kv_slots:
            lens.append(lens[-1] + s.numel())
        return cls(
            cu=torch.tensor(seg.cu_list, dtype=long),
            prefix=torch.tensor(seg.prefix_lens, dtype=long),
            kv_cu=torch.tensor(lens, dtype=long),
            slots=torch.cat([s.to(long) for s in seg.kv_slots]).contiguous(),
            longest=max(s.numel() for s in seg.kv_slots),
        )

    def gather_buffers(self, block: int, hkv: int, d: int, dv: int) -> tuple[torch.Tensor, int]:
        """One bf16 buffer for the kernel's gathered keys ``[Hkv][Lp][D]`` then value pairs
        ``[Hkv][Lp/2][Dv][2]``, and Lp: the longest request's keys rounded up to ``block``.
        Allocated here, by torch, so that running out of memory raises (a C abort would take
        the server down)."""
        lp = -(-self.longest // block) * block
        if (hkv, d, dv) not in self.buffers:
            self.buffers[hkv, d, dv] = torch.empty(hkv * lp * (d + dv), dtype=torch.bfloat16)
        return self.buffers[hkv, d, dv], lp


# tests and benchmarks: False keeps prefill attention on the reference (ATen's flash kernel)
NATIVE_PREFILL_ATTENTION = True


def attention_prefill_fits(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether ``attention_prefill``'s kernel takes these queries and pools (the caller can
    skip building ``PrefillKeys`` where it does not)."""
    lib = native.load("attention_prefill")
    Hq, D = q.shape[1], q.shape[2]
    Hkv, Dv = k_pool.shape[1], v_pool.shape[-1]
    return (
        NATIVE_PREFILL_ATTENTION
        and lib is not None
        and bool(lib.attention_prefill_supported())
        and q.is_cpu
        and _cpu_dense(k_pool, torch.bfloat16)
        and _cpu_dense(v_pool, torch.bfloat16)
        and D % 2 == 0
        and Dv % 16 == 0
        and Hq % Hkv == 0
    )


def attention_prefill(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    keys: PrefillKeys,
    scale: float,
) -> torch.Tensor | None:
    """Every prefill request's causal attention over its cached prefix and new tokens
    (``attention.attention_prefill`` for each, ``q`` ``[T, Hq, D]``) in one C call: AVX-512 BF16
    dot products on bf16 pools, each request's keys gathered once per KV head
    (``csrc/attention_prefill.c``), each query's result a function of its keys and position
    alone (the same bits cache on or off, in any batch).
    None where that kernel does not apply (no AVX-512 BF16 in the build, fp32 pools, a value
    head size not a multiple of 16): the caller runs the reference."""
    if not attention_prefill_fits(q, k_pool, v_pool):
        return None
    if not keys.slots.is_cpu or keys.slots.numel() == 0 or int(keys.cu[-1]) != q.shape[0]:
        return None
    lib = native.load("attention_prefill")
    Hq, D = q.shape[1], q.shape[2]
    Hkv, Dv = k_pool.shape[1], v_pool.shape[-1]
    qb = q.to(torch.bfloat16)
    if qb.stride(2) != 1 or qb.stride(1) != D:
        qb = qb.contiguous()
    buf, lp = keys.gather_buffers(lib.attention_prefill_block(), Hkv, D, Dv)
    out = torch.empty(q.shape[0], Hq, Dv, dtype=torch.bfloat16)
    lib.attention_prefill_bf16(
        keys.prefix.shape[0], keys.cu.data_ptr(), keys.prefix.data_ptr(),
        keys.kv_cu.data_ptr(), keys.slots.data_ptr(), Hq, Hkv, D, Dv,
        qb.data_ptr(), qb.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), scale,
        buf.data_ptr(), buf[Hkv * lp * D :].data_ptr(), lp, out.data_ptr(),
    )  # fmt: skip
    return out if q.dtype == torch.bfloat16 else out.to(q.dtype)


def moe_pad(
    x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.moe.moe_pad`` in one C pass: count, place and copy each pair's row (fp32 or
    bf16 rows)."""
    fn = _native_fn(native.load("moe"), "moe_pad", x.dtype)
    if fn is None or not _cpu_rows(x, x.dtype) or ids.device.type != "cpu":
        _fallback("moe_pad", x)
        return moe.moe_pad(x, ids, num_experts)
    T, K = ids.shape
    H = x.shape[1]
    ids = ids.to(torch.int64).contiguous()
    buf = torch.empty(num_experts, T, H, dtype=x.dtype)
    pos = torch.empty(T * K, dtype=torch.int64)
    cap = fn(
        T, K, num_experts, H, x.data_ptr(), x.stride(0), ids.data_ptr(),
        buf.data_ptr(), pos.data_ptr(),
    )  # fmt: skip
    if cap < 0:
        raise ValueError(
            f"moe_pad: an expert id is outside 0..{num_experts - 1} or repeats within a token"
        )
    return buf[:, :cap], pos


# the C call takes batches of at most this many (token, expert) pairs an expert on average
# (decode batches: a few rows an expert, read at memory speed); larger ones are GEMMs
MOE_NATIVE_PAIRS_PER_EXPERT = 8


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: str,
    gated: bool = True,
) -> torch.Tensor | None:
    """The backend op ``moe_experts`` for a decode batch of bf16 rows in one C call
    (``csrc/linear.c``: ``moe_experts_bf16``): each expert's rows through its block (gated
    silu as ``gated_mlp``'s, or plain relu², Nemotron-H's), so only the routed experts' weights
    are read (the padded batched GEMM reads all of them: at batch 1 ~10x the bytes for
    Granite-4.0-H-tiny's 6 of 64 experts). Returns None for inputs it does not cover (the
    caller runs the reference)."""
    covered = act in ("silu", "swish") if gated else act == "relu2"
    dense = isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    if x.dtype is not torch.bfloat16 or not x.is_cpu or not covered or not dense:
        return None  # (fp8 stacks: the reference's loop, each expert through fp8 linears)
    T, K = ids.shape
    E, u, h = gate_up.shape
    i = u // 2 if gated else u
    if T * K > MOE_NATIVE_PAIRS_PER_EXPERT * E or x.dim() != 2:
        return None
    lib = native.load("linear")
    fits = (
        lib is not None
        and x.stride(1) == 1
        and tuple(x.shape) == (T, h)  # (the C code reads a row for every token of ids)
        and _cpu_dense(gate_up, torch.bfloat16)
        and _cpu_dense(down, torch.bfloat16)
        and tuple(down.shape) == (E, h, i)
        and ids.is_cpu
        and weights.is_cpu
        and tuple(weights.shape) == (T, K)
    )
    if not fits:
        _fallback("moe_experts", x, gate_up)
        return None
    P = T * K
    ids = ids.to(torch.int64).contiguous()
    w = weights.to(torch.float32).contiguous()
    rows = torch.empty(P * (2 * h + u + i), dtype=torch.bfloat16)  # xs | gate|up | act | y
    idx = torch.empty(2 * P + 2 * E + 1, dtype=torch.int64)
    out = torch.empty(T, h, dtype=torch.bfloat16)
    gu = rows[P * h :]
    act_rows = gu[P * u :]
    y = act_rows[P * i :]
    lib.moe_experts_bf16(
        T, K, E, i, h, int(gated), x.data_ptr(), x.stride(0), ids.data_ptr(), w.data_ptr(),
        gate_up.data_ptr(), down.data_ptr(), rows.data_ptr(), gu.data_ptr(),
        act_rows.data_ptr(), y.data_ptr(), idx.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


def moe_unpad(
    y: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``kernels.moe.moe_unpad`` in one C pass per token: fp32, or bf16 expert outputs with
    fp32 or bf16 weights summed in fp32 (the reference's result dtype, rounded once)."""
    lib = native.load("moe")
    fits = (
        lib is not None
        and y.dtype in (torch.float32, torch.bfloat16)
        and weights.dtype in (torch.float32, y.dtype)
        and y.is_cpu
        and y.dim() == 3
        and y.stride(2) == 1
        and y.stride(1) == y.shape[2]
        and ids.is_cpu
    )
    if not fits:
        _fallback("moe_unpad", y, weights)
        return moe.moe_unpad(y, ids, pos, weights)
    T, K = ids.shape
    H = y.shape[2]
    ids = ids.to(torch.int64).contiguous()
    pos = pos.to(torch.int64).contiguous()
    out_dtype = torch.result_type(y, weights)
    out = torch.empty(T, H, dtype=out_dtype)
    if y.dtype == torch.float32:
        weights = weights.contiguous()
        lib.moe_unpad(
            T, K, H, y.data_ptr(), y.stride(0), ids.data_ptr(), pos.data_ptr(),
            weights.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out
    weights = weights.float().contiguous()
    lib.moe_unpad_bf16(
        T, K, H, y.data_ptr(), y.stride(0), ids.data_ptr(), pos.data_ptr(),
        weights.data_ptr(), out.data_ptr(), int(out_dtype == torch.bfloat16),
    )  # fmt: skip
    return out


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """``kernels.rope.rms_norm_rope`` in one C pass per head (x's heads may be strided; fp32
    or bf16 data; the rotation of bf16 data in fp32, rounded once)."""
    fn = _native_fn(native.load("rms_norm"), "rms_norm_rope", x.dtype)
    T, H, D = x.shape
    rd = cos.shape[-1]
    fits = (
        fn is not None
        and x.is_cpu
        and x.stride(2) == 1
        and _cpu_dense(weight, x.dtype)
        and all(t.shape == (T, rd) and t.is_cpu for t in (cos, sin))
        and rd % 2 == 0
        and rd <= D
    )
    if not fits:
        _fallback("rms_norm_rope", x, weight, cos)
        return rope.rms_norm_rope(x, weight, eps, zero_centered, cos, sin)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(T, H, D, dtype=x.dtype)
    fn(
        T, H, D, x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(), eps,
        int(zero_centered), cos.data_ptr(), sin.data_ptr(), rd, out.data_ptr(),
    )  # fmt: skip
    return out


def conv1d_update(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    cu: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One conv step of B requests in place on ``conv_pool`` at ``slots`` (C, one pass per
    state): ``kernels.conv.causal_conv1d_update`` with the gather and scatter fused; with
    ``cu`` / ``row_slots``, decodes of several positions (``gated_delta_decode``). Returns
    the output ``[rows, C]``, or None where the C code does not cover the inputs (the caller
    runs the reference)."""
    dt = x.dtype
    fn = _native_fn(native.load("ssm_decode"), "conv1d_update", dt)
    fits = (
        fn is not None
        and activation in _SILU
        and _cpu_rows(x, dt)
        and all(_cpu_dense(t, dt) for t in (conv_pool, weight))
        and (bias is None or _cpu_dense(bias, dt))
        and slots.is_cpu
        and tuple(conv_pool.shape[1:]) == (x.shape[1], weight.shape[1] - 1)
        and _positions_fit(cu, row_slots, x.shape[0])
    )
    if not fits:
        _fallback("conv1d_update", x, conv_pool, weight)
        return None
    slots = slots.to(torch.int64).contiguous()
    B, C = x.shape
    out = torch.empty(B, C, dtype=dt)
    fn(
        slots.shape[0], slots.data_ptr(), *_positions(cu, row_slots), x.data_ptr(), x.stride(0),
        conv_pool.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), C, weight.shape[1],
        _SILU[activation],
    )  # fmt: skip
    return out


def mamba2_step(
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    cu: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One Mamba2 scan step of the requests in place on ``ssm_pool`` at ``slots`` (C, fp32
    state read and written once): ``kernels.mamba2.mamba2_step`` with the gather and scatter
    fused; with ``cu`` / ``row_slots``, decodes of several positions (``gated_delta_decode``).
    ``x`` ``[S, H, P]``, ``B`` / ``C`` ``[S, G, N]`` (S rows) may be row-strided views. Returns
    ``y`` ``[S, H, P]`` fp32, or None where the C code does not cover the inputs."""
    xd = x.dtype
    fn = _native_fn(native.load("ssm_decode"), "mamba2_step", xd)
    S, H, P = x.shape
    G, N = B.shape[1], B.shape[2]

    def rows(t: torch.Tensor, inner: tuple[int, ...]) -> bool:  # dense but for the row stride
        return t.is_cpu and t.dtype == xd and t.stride()[1:] == inner

    fits = (
        fn is not None
        and _cpu_dense(ssm_pool, torch.float32)
        and tuple(ssm_pool.shape[1:]) == (H, P, N)
        and rows(x, (P, 1))
        and rows(B, (N, 1))
        and rows(C, (N, 1))
        and B.stride(0) == C.stride(0)
        and H % G == 0
        and (D is None or _cpu_dense(D, xd))
        and slots.is_cpu
        and _positions_fit(cu, row_slots, S)
    )
    if not fits:
        _fallback("mamba2_step", x, ssm_pool, B)
        return None
    slots = slots.to(torch.int64).contiguous()
    dt = dt.float().contiguous()
    A = A.float().contiguous()
    y = torch.empty(S, H, P, dtype=torch.float32)
    fn(
        slots.shape[0], slots.data_ptr(), *_positions(cu, row_slots), ssm_pool.data_ptr(),
        x.data_ptr(), x.stride(0), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(),
        B.stride(0),
        None if D is None else D.data_ptr(), y.data_ptr(), H, P, G, N,
    )  # fmt: skip
    return y


@dataclass(slots=True, frozen=True)
class ScanSegments:
    """A forward's prefill segments as the native prefill kernels take them, built once per
    forward (in ``CpuBackend``'s per-forward index) and shared by every layer: int64 state slots
    ``[S]`` and ``cu_seqlens`` ``[S+1]``, and the snapshots as (segment, offset, slot), sorted by
    segment, then offset (the order the kernels walk them in)."""

    slots: torch.Tensor
    cu: torch.Tensor
    num_tokens: int
    snap_seq: torch.Tensor
    snap_off: torch.Tensor
    snap_slot: torch.Tensor

    @classmethod
    def of(cls, seg: PrefillSegments) -> ScanSegments:
        seqs, offs = seg.snapshot_seqs, seg.snapshot_offsets
        order = sorted(range(len(seqs)), key=lambda k: (seqs[k], offs[k]))
        long = torch.int64
        return cls(
            slots=seg.state_slots.to(long).contiguous(),
            cu=torch.tensor(seg.cu_list, dtype=long),
            num_tokens=seg.cu_list[-1],
            snap_seq=torch.tensor([seqs[k] for k in order], dtype=long),
            snap_off=torch.tensor([offs[k] for k in order], dtype=long),
            snap_slot=seg.snapshot_slots.to(long)[order].contiguous()
            if order
            else torch.empty(0, dtype=long),
        )

    def covers(self, num_tokens: int) -> bool:
        return self.slots.is_cpu and self.num_tokens == num_tokens

    def head(self) -> tuple[int, int, int]:
        """The kernels' first arguments: segment count, cu_seqlens, slots."""
        return self.slots.shape[0], self.cu.data_ptr(), self.slots.data_ptr()

    def snapshots(self) -> tuple[int, int, int, int]:
        """The kernels' last arguments: snapshot count, segments, offsets, slots."""
        return (
            self.snap_seq.shape[0], self.snap_seq.data_ptr(), self.snap_off.data_ptr(),
            self.snap_slot.data_ptr(),
        )  # fmt: skip


def conv1d_prefill(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    seg: ScanSegments,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor | None:
    """The causal conv of varlen prefill segments (C, one pass): ``kernels.conv.causal_conv1d``
    with every segment's state carried from and to its slot in ``conv_pool`` and the state after
    each snapshot's offset written to the snapshot's slot.
    ``x`` ``[T, C]`` may have strided rows. Returns ``[T, C]`` (token-major), or None where the
    C code does not cover the inputs."""
    xd = x.dtype
    fn = _native_fn(native.load("conv_prefill"), "conv1d_prefill", xd)
    T, C = x.shape
    fits = (
        fn is not None
        and _cpu_rows(x, xd)
        and _cpu_dense(conv_pool, xd)
        and conv_pool.shape[1] == C
        and _cpu_dense(weight, xd)
        and weight.shape == (C, conv_pool.shape[2] + 1)
        and (bias is None or _cpu_dense(bias, xd))
        and activation in _SILU
        and seg.covers(T)
    )
    if not fits:
        _fallback("conv1d_prefill", x, conv_pool, weight)
        return None
    out = torch.empty(T, C, dtype=xd)
    status = fn(
        *seg.head(), x.data_ptr(), x.stride(0), conv_pool.data_ptr(), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), C, weight.shape[1],
        _SILU[activation], *seg.snapshots(),
    )  # fmt: skip
    return out if status == 0 else None  # -1: a kernel wider than the C code holds


def mamba2_scan(
    ssm_pool: torch.Tensor,
    seg: ScanSegments,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> torch.Tensor | None:
    """The Mamba2 prefill scan of varlen segments in place on ``ssm_pool`` (C, token after
    token: ``kernels.mamba2.mamba2_chunk_scan``'s results): segment s is rows ``cu[s] :
    cu[s + 1]`` of ``x`` ``[T, H, P]``, ``dt`` ``[T, H]`` (processed), ``B`` / ``C``
    ``[T, G, N]`` (views of the conv output, token- or channel-major), its state in its slot;
    each snapshot's slot gets the state after that many tokens of its segment. Returns ``y``
    ``[T, H, P]`` fp32, or None where the C code does not cover the inputs."""
    xd = x.dtype
    fn = _native_fn(native.load("ssm_decode"), "mamba2_scan", xd)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    fits = (
        fn is not None
        and _cpu_dense(ssm_pool, torch.float32)
        and tuple(ssm_pool.shape[1:]) == (H, P, N)
        and all(t.is_cpu and t.dtype == xd for t in (x, B, C))
        and x.stride(1) == P * x.stride(2)  # channels h * P + p at one stride
        and B.stride() == C.stride()
        and B.stride(1) == N * B.stride(2)
        and H % G == 0
        and (D is None or _cpu_dense(D, xd))
        and seg.covers(T)
    )
    if not fits:
        _fallback("mamba2_scan", x, ssm_pool, B)
        return None
    dt = dt.float().contiguous()
    A = A.float().contiguous()
    y = torch.empty(T, H, P, dtype=torch.float32)
    status = fn(
        *seg.head(), ssm_pool.data_ptr(), x.data_ptr(), x.stride(0), x.stride(2), dt.data_ptr(),
        A.data_ptr(), B.data_ptr(), C.data_ptr(), B.stride(0), B.stride(2),
        None if D is None else D.data_ptr(), y.data_ptr(), H, P, G, N, *seg.snapshots(),
    )  # fmt: skip
    return y if status == 0 else None  # -1: no memory for its scratch, nothing done


def gated_delta_scan(
    ssm_pool: torch.Tensor,
    seg: ScanSegments,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor | None:
    """The Gated DeltaNet prefill scan of varlen segments in place on ``ssm_pool`` (C, token
    after token: ``kernels.gated_delta.chunk_gated_delta_rule``'s results, q and k
    L2-normalised inside): segment s is rows ``cu[s] : cu[s + 1]`` of ``q``, ``k``
    ``[T, Hk, Dk]`` and ``v`` ``[T, Hv, Dv]`` (views of the conv output, token- or
    channel-major), ``g`` / ``beta`` ``[T, Hv]``; states and snapshots as in ``mamba2_scan``.
    Returns the output ``[T, Hv, Dv]`` in ``v``'s
    dtype, or None where the C code does not cover the inputs."""
    vd = v.dtype
    fn = _native_fn(native.load("gated_delta_scan"), "gated_delta_scan", vd)
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    fits = (
        fn is not None
        and _cpu_dense(ssm_pool, torch.float32)
        and tuple(ssm_pool.shape[1:]) == (hv, dk, dv)
        and all(t.is_cpu and t.dtype == vd for t in (q, k, v, beta))
        and q.stride() == k.stride()
        and q.stride(1) == dk * q.stride(2)  # channels h * Dk + i at one stride
        and v.stride(1) == dv * v.stride(2)
        and hv % hk == 0
        and seg.covers(T)
    )
    if not fits:
        _fallback("gated_delta_scan", v, ssm_pool, beta)
        return None
    g = g.float().contiguous()
    beta = beta.contiguous()
    out = torch.empty(T, hv, dv, dtype=vd)
    status = fn(
        *seg.head(), ssm_pool.data_ptr(), q.data_ptr(), k.data_ptr(), q.stride(0), q.stride(2),
        v.data_ptr(), v.stride(0), v.stride(2), g.data_ptr(), beta.data_ptr(), out.data_ptr(),
        hk, hv, dk, dv, 1, *seg.snapshots(),
    )  # fmt: skip
    return out if status == 0 else None  # -1: no memory for its scratch, nothing done


def mamba2_decode(
    xbc: torch.Tensor,
    dt_raw: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    activation: str | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    D: torch.Tensor | None,
    shape: tuple[int, int, int, int],
    out_norm: norm.GatedNorm | None = None,
    cu: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A Mamba2 decode step in one C call (``csrc/ssm_decode.c`` ``mamba2_decode``): the conv
    of ``xbc`` ``[B, C]`` and the scan step with ``dt_raw`` ``[B, H]`` processed inside, both
    row-strided views of one projection; states in place at ``slots``. ``shape`` is
    ``(H, P, G, N)``; ``cu`` / ``row_slots``: decodes of several positions
    (``gated_delta_decode``). Returns ``y`` ``[rows, H, P]`` in the model dtype or, with
    ``out_norm``, the mixer's output norm of it ``[rows, H * P]`` (``rms_norm_gate_first``; or
    the bare gate, ``silu_gate``, where ``out_norm`` has no weight); None where the C code
    does not cover the inputs (the caller composes the separate steps)."""
    dt = xbc.dtype
    fn = _native_fn(native.load("ssm_decode"), "mamba2_decode", dt)
    H, P, G, N = shape
    C = H * P + 2 * G * N
    fits = (
        fn is not None
        and activation in _SILU
        and _cpu_rows(xbc, dt)
        and _cpu_rows(dt_raw, dt)
        and xbc.stride(0) == dt_raw.stride(0)
        and xbc.shape[1] == C
        and tuple(dt_raw.shape[1:]) == (H,)
        and all(_cpu_dense(t, dt) for t in (conv_pool, conv_weight, A_log, dt_bias))
        and (conv_bias is None or _cpu_dense(conv_bias, dt))
        and (D is None or _cpu_dense(D, dt))
        and tuple(conv_pool.shape[1:]) == (C, conv_weight.shape[1] - 1)
        and _cpu_dense(ssm_pool, torch.float32)
        and tuple(ssm_pool.shape[1:]) == (H, P, N)
        and H % G == 0
        and slots.is_cpu
        and _positions_fit(cu, row_slots, xbc.shape[0])
    )
    if not fits:  # no warning: the steps composed instead name their own fallbacks
        return None
    slots = slots.to(torch.int64).contiguous()
    B = xbc.shape[0]
    y = torch.empty(B, H, P, dtype=dt)
    fold = (
        out_norm is not None
        and out_norm.gate.stride(0) == xbc.stride(0)
        and (H * P) % out_norm.group_size == 0
        and _folds(out_norm, dt, B, H * P, H * P)
    )
    out = torch.empty(B, H * P, dtype=dt) if fold else y
    gate, _, weight, eps = _norm_args(out_norm if fold else None)
    fn(
        slots.shape[0], slots.data_ptr(), *_positions(cu, row_slots), xbc.data_ptr(),
        dt_raw.data_ptr(), xbc.stride(0),
        conv_pool.data_ptr(), conv_weight.data_ptr(),
        None if conv_bias is None else conv_bias.data_ptr(), conv_weight.shape[1],
        _SILU[activation], ssm_pool.data_ptr(), A_log.data_ptr(), dt_bias.data_ptr(),
        dt_limit[0], dt_limit[1], None if D is None else D.data_ptr(), y.data_ptr(), H, P, G, N,
        gate, weight, eps, out_norm.group_size if fold else 0, out.data_ptr(),
    )  # fmt: skip
    if out_norm is None or fold:
        return out
    gn = out_norm
    if gn.weight is None:
        return norm.silu_gate(y.view(B, -1), gn.gate)
    return rms_norm_gate_first(y.view(B, -1), gn.gate, gn.weight, gn.eps, gn.group_size)


# Two C kernels (``csrc/linear.c``) for decode batches, with the same sums bit for bit:
# - rows: each weight row streamed once and dotted with every x row held in cache (the bf16 dot
#   product instruction), so a step of a few rows reads the weights once, at memory speed. Up to
#   LINEAR_NATIVE_MAX_ROWS rows while they take at most LINEAR_NATIVE_X_BYTES (held in cache):
#   beyond, the products rather than the weight read are the cost, and torch's matmul is as fast.
# - tiles: from LINEAR_TILES_MIN_ROWS rows up to bf16_matmul.MIN_ROWS, where the products are the
#   cost: fp32 FMAs on weights widened in registers, on CPUs where fp32 arithmetic beats the bf16
#   one (``bf16_matmul.choice() == "fp32"``: the same property its many-row path is chosen for).
# - without the tile kernel (AVX2 builds: no bf16 dot product, and torch's bf16 matmul a scalar
#   fallback), the rows kernel takes the tiles' range too, up to bf16_matmul.MIN_ROWS rows while
#   their fp32 copy takes at most LINEAR_WIDE_X_BYTES, where fp32 arithmetic is chosen: on an
#   AVX2 EPYC 20-64 rows ran at 24-27 GFMA/s against 7-19 for fp32 copies of the weights and
#   ~5.5 for torch's bf16 matmul.
# - with AMX (``uses_amx``: an Intel Xeon whose tiles the hypervisor passes through and Linux
#   grants; ``$MAMBARADIX_AMX=0`` declines them), every row count below bf16_matmul.MIN_ROWS
#   takes linear.c's tile-unit kernel, whose sums are in another order than the two above: one
#   kernel for every batch keeps a row's result independent of its batch.
# Beyond, torch's matmul or an fp32 one (``kernels.bf16_matmul``). The measurements behind these
# bounds, by CPU model, are in docs/benchmarks.md.
LINEAR_NATIVE_MAX_ROWS = 16
LINEAR_NATIVE_X_BYTES = 160 << 10
LINEAR_TILES_MIN_ROWS = 12
LINEAR_WIDE_X_BYTES = 1 << 20
_tiles: list[bool] = []  # whether this build has the tile kernel's instructions (cached)
_widens: list[bool] = []  # whether its rows kernel widens to fp32 with AVX2 (cached)
_amx: list[bool] = []  # whether its linears run on AMX tiles (cached)


def uses_amx() -> bool:
    """Whether the native linears run on AMX tiles in this process: where this CPU and build
    have them and Linux grants the tile state, unless ``$MAMBARADIX_AMX=0`` (read once). On the
    Intel Xeon measured, a one-token step took 1.06-1.13x its time with them, and 16 decode
    rows' linears 0.32-0.40x (docs/benchmarks.md, 2026-12-06): a server's batches gain far
    more than a lone request loses; ``=0`` keeps the dot-product kernels for one request's
    latency."""
    if not _amx:
        lib = native.load("linear")
        on = lib is not None and bool(lib.linear_amx(os.environ.get("MAMBARADIX_AMX") != "0"))
        _amx.append(on)
    return _amx[0]


def set_amx(on: bool) -> bool:
    """Turn the AMX kernel off, or on where this CPU and kernel grant it (tests, and where one
    path must be measured against the other); returns whether it is on. Not while a linear runs."""
    lib = native.load("linear")
    got = lib is not None and bool(lib.linear_amx(1 if on else 0))
    _amx[:] = [got]
    return got


def _use_tiles(m: int) -> bool:
    """Whether ``m`` rows take the tile kernel (the caller has checked the dtypes)."""
    if m < LINEAR_TILES_MIN_ROWS or m >= bf16_matmul.MIN_ROWS:
        return False
    if not _tiles:
        lib = native.load("linear")
        _tiles.append(lib is not None and bool(lib.linear_uses_dpbf16()))
    return _tiles[0] and bf16_matmul.choice() == "fp32"


def _wide_rows(m: int, k: int) -> bool:
    """Whether ``m`` rows of ``k`` beyond LINEAR_NATIVE_MAX_ROWS take the rows kernel (a build
    without the tile kernel whose rows kernel widens to fp32; the caller has checked dtypes)."""
    if m >= bf16_matmul.MIN_ROWS or m * k * 4 > LINEAR_WIDE_X_BYTES:
        return False
    if not _widens:
        lib = native.load("linear")
        _widens.append(lib is not None and bool(lib.linear_uses_f32x()))
    return _widens[0] and bf16_matmul.choice() == "fp32"


def bf16_linear_kernels() -> bool:
    """Whether this build's linear kernels compute bf16 rows in SIMD registers (the bf16 dot
    product, or AVX2's widening to fp32) rather than the portable loop."""
    lib = native.load("linear")
    return lib is not None and bool(lib.linear_uses_dpbf16() or lib.linear_uses_f32x())


def _decode_kernel(m: int, k: int) -> str | None:
    """Which C kernel takes ``m`` bf16 rows of ``k`` (``tiles``, ``rows``), or None (torch)."""
    if uses_amx():
        return "rows" if 0 < m < bf16_matmul.MIN_ROWS else None
    if _use_tiles(m):
        return "tiles"
    if 0 < m <= LINEAR_NATIVE_MAX_ROWS and (m == 1 or m * k * 2 <= LINEAR_NATIVE_X_BYTES):
        return "rows"
    if m > LINEAR_NATIVE_MAX_ROWS and _wide_rows(m, k):
        return "rows"
    return None


def _tile_scratch(m: int, k: int) -> torch.Tensor:
    """fp32 scratch the tile kernel packs ``m`` x rows of ``k`` into (k rounded up to 32)."""
    return torch.empty(m * ((k + 31) // 32 * 32), dtype=torch.float32)


def gated_mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str
) -> torch.Tensor | None:
    """A SiLU-gated feed-forward block of a decode batch of bf16 rows in one C call
    (``csrc/linear.c``): the backend op ``gated_mlp`` with the roundings of its composition.
    Returns None for inputs it does not cover (the caller composes the block)."""
    if x.dtype is not torch.bfloat16 or not x.is_cpu or act not in ("silu", "swish"):
        return None
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    m, h = rows.shape
    i = down.shape[1]
    kernel = _decode_kernel(m, max(h, i))  # (rows: both products' x rows fit in cache)
    if kernel is None:
        return None
    lib = native.load("linear")
    fits = (
        lib is not None
        and rows.stride(1) == 1
        and _cpu_dense(gate_up, torch.bfloat16)
        and _cpu_dense(down, torch.bfloat16)
        and gate_up.shape == (2 * i, h)
        and down.shape == (h, i)
    )
    if not fits:
        _fallback("gated_mlp", x, gate_up)
        return None
    scratch = torch.empty(3 * m * i, dtype=torch.bfloat16)  # gate|up [m, 2i], then [m, i]
    out = torch.empty(m, h, dtype=torch.bfloat16)
    xs = _tile_scratch(m, max(h, i)) if kernel == "tiles" else None
    lib.gated_mlp_bf16(
        m, i, h, rows.data_ptr(), rows.stride(0), gate_up.data_ptr(), down.data_ptr(),
        scratch.data_ptr(), scratch[2 * m * i :].data_ptr(), out.data_ptr(),
        None if xs is None else xs.data_ptr(),
    )  # fmt: skip
    return out.view(x.shape)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``; for decode batches of bf16 rows in C (``csrc/linear.c``: a few rows at
    memory speed, tens of rows in fp32 FMAs where this CPU runs them faster), for many bf16 rows
    by whichever of torch's bf16 matmul and an fp32 one is faster on this CPU
    (``kernels.bf16_matmul``); fp32 stays with torch's matmul.
    An fp8 weight (``kernels.fp8``) takes ``fp8.linear_cpu``.
    (Called ~140 times a decode step: the checks are written for speed, ~3 us of Python.)"""
    if type(weight) is fp8.Fp8Weight:
        return fp8.linear_cpu(x, weight, bias, linear)
    if x.dtype is not torch.bfloat16 or not x.is_cpu:
        return F.linear(x, weight, bias)
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    m, k = rows.shape
    kernel = _decode_kernel(m, k)
    if kernel is None:
        if weight.dtype is torch.bfloat16 and weight.is_cpu:
            return bf16_matmul.linear(x, weight, bias)  # many rows: the faster of two paths
        return F.linear(x, weight, bias)
    lib = native.load("linear")
    fits = (
        lib is not None
        and rows.stride(1) == 1
        and weight.dtype is torch.bfloat16
        and weight.is_cpu
        and weight.is_contiguous()
        and weight.shape[1] == k
        and (bias is None or _cpu_dense(bias, torch.bfloat16))
    )
    if not fits:
        _fallback("linear", x, weight)
        return F.linear(x, weight, bias)
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    args = (
        m, n, k, rows.data_ptr(), rows.stride(0), weight.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if kernel == "tiles":
        xs = _tile_scratch(m, k)  # (held until the call returns)
        lib.linear_bf16_many(*args, xs.data_ptr())
    else:
        lib.linear_bf16(*args)
    return out if flat else out.view(*x.shape[:-1], n)
