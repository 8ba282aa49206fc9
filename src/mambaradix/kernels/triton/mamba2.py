"""The Mamba2 selective scan as Triton kernels, over SSM states pooled by slot.

Semantics are the reference's (``kernels/mamba2.py``, ``TorchBackend.mamba2_prefill`` /
``mamba2_decode``): per head ``h`` (group ``h // (H // G)``), ``s_t = exp(dt_t A) s_{t-1} +
dt_t x_t B_t^T`` and ``y_t = s_t C_t + D x_t``; every product in fp32, the state ``[P, N]`` kept in
fp32 and stored in the pool's dtype (a bf16 pool rounds each state it stores, never the running
one), ``y`` returned in fp32.

Prefill design: one program per (segment, head, block of 16 values of P) owns that block's
state in registers for the whole segment and walks it chunk by chunk, in sequence; inside a
chunk of ``L = 32`` tokens it runs the chunked (SSD) form as small matrix products::

    y     = (C B^T * decay) (dt x)  +  exp(cumsum a) * (C s)          + D x     a = dt A
    s_new = exp(sum a) s  +  B^T (dt x * exp(sum of a after each token))        s: [N, P]

A chunk ends early at any snapshot offset of its segment, so the state there is exact and
snapshots fall at any offset, as the reference's pieces do (the backend's declared stride of 64
is not needed here). Why this form:

- against a token-by-token scan (exact, simplest): a GPU would wait on a dependent load and a
  cross-thread reduction over N for every token; here each chunk is a few coalesced ``[L, N/2]``
  loads of B and C rows and tensor-core products, at the price of recomputing ``C B^T`` for every
  block of P (a quarter of the products at P = 64);
- against the fully parallel SSD (chunk states in parallel, a state-passing pass, outputs in
  parallel: mamba_ssm's five kernels): one launch and no intermediate buffers, but parallelism
  is only segments x heads x P/16 programs and the chunks of a segment run in sequence, so a
  lone long prefill on a model with few heads (Granite-4.0-H-350M: 24 heads, 96 programs)
  leaves part of an H200's 132 multiprocessors idle. For those prefills the parallel form is
  in ``mamba2_chunked.py`` (three launches over fla-core's chunks of 64, so its snapshots are
  chunk-start states as the Gated DeltaNet's); ``prefers_chunked`` there picks per forward
  from host integers.

The state is held transposed (``[N, P]``) and in two halves of N: a whole ``[L, N]`` fp32
operand spilled registers (ptxas for sm_90a: 255 registers and 2 KB of spills in fp32 before the
split; 76 B in bf16 and 284 B in fp32 after, at ``L = 32``, 16 values of P, 8 warps). These
knobs (``_launch_prefill``) are not yet tuned on a GPU.

Precision: the decays within a chunk are exponentials of segment sums taken by a cumulative
sum over a masked ``[L, L]`` tile (each ``sum_{j<k<=i} a_k`` summed on its own, never the
difference of two large prefix sums, which the reference avoids with float64). Products of
fp32 operands use ``tf32x3`` (three TF32 passes, about fp32 accuracy; plain TF32 would be ~1e-3
off); ``C B^T`` of bf16 inputs uses one TF32 pass, exact for bf16 values. The interpreter does
not emulate TF32, so only a GPU run checks these choices.

Decode: one program per (request, head, block of 32 values of P) updates its ``[32, N]`` state
tile in place; a verify step's request walks its rows in the same program, storing the state
after each into that row's slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaradix.kernels.triton.conv import request_rows, row_slot

CHUNK = 32  # tokens per chunk of the prefill scan
PREFILL_BLOCK_P = 16
PREFILL_WARPS = 8
DECODE_BLOCK_P = 32
FP32_DOT = "tf32x3"


@triton.jit
def _rows(row_ptrs, row_mask, n, n_mask, s_n):
    """A ``[L, len(n)]`` fp32 tile of B or C rows, 0 where masked (0 * NaN would reach the
    state through the products)."""
    tile = tl.load(row_ptrs + n[None, :] * s_n, mask=row_mask[:, None] & n_mask[None, :], other=0.0)
    return tile.to(tl.float32)


@triton.jit
def _mamba2_prefill_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, pool_ptr, y_ptr, cu_ptr, slots_ptr,
    snap_seqs_ptr, snap_offsets_ptr, snap_slots_ptr, num_snaps,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n,
    sp_s, sp_h, sp_p, sp_n, sy_t, sy_h, sy_p,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, SNAP_BLOCK: tl.constexpr, L: tl.constexpr,
    CB_DOT: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    seg, h = tl.program_id(0), tl.program_id(1)
    g = h // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < P
    # the state transposed, [N, P], in two halves of N (n0, n1): every product's operands
    # then stay small enough for registers (a whole [L, N] fp32 operand spills)
    HALF: tl.constexpr = BLOCK_N // 2
    n0 = tl.arange(0, HALF)
    n1 = n0 + HALF
    m0, m1 = n0 < N, n1 < N
    offs0 = h * sp_h + n0[:, None] * sp_n + p[None, :] * sp_p
    offs1 = h * sp_h + n1[:, None] * sp_n + p[None, :] * sp_p
    mask0, mask1 = m0[:, None] & p_mask[None, :], m1[:, None] & p_mask[None, :]
    start = tl.load(cu_ptr + seg)
    end = tl.load(cu_ptr + seg + 1)
    state_ptr = pool_ptr + tl.load(slots_ptr + seg).to(tl.int64) * sp_s
    s0 = tl.load(state_ptr + offs0, mask=mask0, other=0.0).to(tl.float32)
    s1 = tl.load(state_ptr + offs1, mask=mask1, other=0.0).to(tl.float32)
    a_h = tl.load(A_ptr + h).to(tl.float32)
    # this segment's snapshot offsets, as packed rows (end + 1: not this segment's)
    j = tl.arange(0, SNAP_BLOCK)
    j_mask = j < num_snaps
    mine = (tl.load(snap_seqs_ptr + j, mask=j_mask, other=-1) == seg) & j_mask
    cuts = tl.where(mine, start + tl.load(snap_offsets_ptr + j, mask=j_mask, other=0), end + 1)
    r = tl.arange(0, L)
    causal = r[:, None] >= r[None, :]
    pos = start
    while pos < end:
        # the chunk: rows pos .. stop-1, ending early at the next snapshot
        stop = tl.minimum(tl.min(tl.where(cuts > pos, cuts, end + 1), axis=0), pos + L)
        stop = tl.minimum(stop, end)
        t = pos + r
        t_mask = t < stop
        t64 = t.to(tl.int64)
        tp_mask = t_mask[:, None] & p_mask[None, :]
        dt = tl.load(dt_ptr + t64 * sdt_t + h * sdt_h, mask=t_mask, other=0.0).to(tl.float32)
        x = tl.load(
            x_ptr + t64[:, None] * sx_t + h * sx_h + p[None, :] * sx_p, mask=tp_mask, other=0.0
        )
        x = x.to(tl.float32)
        B_rows = B_ptr + t64[:, None] * sb_t + g * sb_g
        C_rows = C_ptr + t64[:, None] * sc_t + g * sc_g
        # C B^T and C s over the two halves of N
        C_half = _rows(C_rows, t_mask, n0, m0, sc_n)
        cb = tl.dot(C_half, tl.trans(_rows(B_rows, t_mask, n0, m0, sb_n)), input_precision=CB_DOT)
        c_s = tl.dot(C_half, s0, input_precision=FP32_DOT)
        C_half = _rows(C_rows, t_mask, n1, m1, sc_n)
        cb = tl.dot(
            C_half, tl.trans(_rows(B_rows, t_mask, n1, m1, sb_n)), cb, input_precision=CB_DOT
        )
        c_s = tl.dot(C_half, s1, c_s, input_precision=FP32_DOT)
        a = dt * a_h  # padded rows: a = 0, x = B = C = 0 (decay 1, no input)
        # seg[i, k] = sum of a over (k, i]: a cumulative sum of its own per column
        seg_sum = tl.cumsum(tl.where(r[:, None] > r[None, :], a[:, None], 0.0), axis=0)
        xdt = x * dt[:, None]
        y = tl.dot(cb * tl.where(causal, tl.exp(seg_sum), 0.0), xdt, input_precision=FP32_DOT)
        y += tl.exp(tl.cumsum(a, axis=0))[:, None] * c_s
        if HAS_D:
            y += x * tl.load(D_ptr + h).to(tl.float32)
        tl.store(y_ptr + t64[:, None] * sy_t + h * sy_h + p[None, :] * sy_p, y, mask=tp_mask)
        # s = exp(sum a) s + B^T (dt x * exp(sum of a after each row))
        after = tl.cumsum(a, axis=0, reverse=True) - a
        weighted = xdt * tl.exp(after)[:, None]
        decay = tl.exp(tl.sum(a, axis=0))
        B_half = tl.trans(_rows(B_rows, t_mask, n0, m0, sb_n))
        s0 = s0 * decay + tl.dot(B_half, weighted, input_precision=FP32_DOT)
        B_half = tl.trans(_rows(B_rows, t_mask, n1, m1, sb_n))
        s1 = s1 * decay + tl.dot(B_half, weighted, input_precision=FP32_DOT)
        if tl.sum((cuts == stop).to(tl.int32), axis=0) > 0:
            for k in range(num_snaps):
                hit = (tl.load(snap_seqs_ptr + k) == seg) & (
                    start + tl.load(snap_offsets_ptr + k) == stop
                )
                dst = pool_ptr + tl.load(snap_slots_ptr + k).to(tl.int64) * sp_s
                tl.store(dst + offs0, s0.to(pool_ptr.dtype.element_ty), mask=mask0 & hit)
                tl.store(dst + offs1, s1.to(pool_ptr.dtype.element_ty), mask=mask1 & hit)
        pos = stop
    tl.store(state_ptr + offs0, s0.to(pool_ptr.dtype.element_ty), mask=mask0)
    tl.store(state_ptr + offs1, s1.to(pool_ptr.dtype.element_ty), mask=mask1)


@triton.jit
def _mamba2_decode_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, pool_ptr, y_ptr, slots_ptr, cu_ptr,
    row_slots_ptr, sx_b, sx_h, sx_p, sdt_b, sdt_h, sb_b, sb_g, sb_n, sc_b, sc_g, sc_n,
    sp_s, sp_h, sp_p, sp_n, sy_b, sy_h, sy_p,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, MULTI: tl.constexpr,
):  # fmt: skip
    req, h = tl.program_id(0), tl.program_id(1)
    g = h // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < P, n < N
    slot = tl.load(slots_ptr + req).to(tl.int64)
    tile = h * sp_h + p[:, None] * sp_p + n[None, :] * sp_n
    state_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(pool_ptr + slot * sp_s + tile, mask=state_mask, other=0.0).to(tl.float32)
    a_h = tl.load(A_ptr + h).to(tl.float32)
    # rows: one per request, or (MULTI: a verify step's) rows cu[req]:cu[req + 1], the state
    # after each into its row's slot (the working slot after the last)
    b, end = request_rows(cu_ptr, req, MULTI)
    while b < end:
        x = tl.load(x_ptr + b * sx_b + h * sx_h + p * sx_p, mask=p_mask, other=0.0)
        x = x.to(tl.float32)
        dt = tl.load(dt_ptr + b * sdt_b + h * sdt_h).to(tl.float32)
        Bv = tl.load(B_ptr + b * sb_b + g * sb_g + n * sb_n, mask=n_mask, other=0.0)
        Cv = tl.load(C_ptr + b * sc_b + g * sc_g + n * sc_n, mask=n_mask, other=0.0)
        state = state * tl.exp(dt * a_h) + (x * dt)[:, None] * Bv.to(tl.float32)[None, :]
        y = tl.sum(state * Cv.to(tl.float32)[None, :], axis=1)
        if HAS_D:
            y += x * tl.load(D_ptr + h).to(tl.float32)
        tl.store(y_ptr + b * sy_b + h * sy_h + p * sy_p, y, mask=p_mask)
        dst = pool_ptr + row_slot(row_slots_ptr, b, slot, MULTI) * sp_s
        state = state.to(pool_ptr.dtype.element_ty)
        tl.store(dst + tile, state, mask=state_mask)
        state = state.to(tl.float32)  # the next position starts from the stored state
        b += 1


def _shapes(x: torch.Tensor, B: torch.Tensor, ssm_pool: torch.Tensor) -> tuple[int, int, int, int]:
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G or ssm_pool.shape[1:] != (H, P, N):
        raise ValueError(
            f"Mamba2 shapes disagree: x {tuple(x.shape)}, B {tuple(B.shape)}, pool "
            f"{tuple(ssm_pool.shape)} (want H divisible by G and a pool of [S, H, P, N])"
        )
    return H, P, G, N


def mamba2_prefill(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    snap_seqs: torch.Tensor,
    snap_offsets: torch.Tensor,
    snap_slots: torch.Tensor,
) -> torch.Tensor:
    """The scan over packed segments: ``x [Tp, H, P]``, ``dt [Tp, H]`` (processed), ``A [H]``,
    ``B, C [Tp, G, N]``, ``D [H]`` or None (any strides); segment ``p`` rows
    ``cu_seqlens[p] : cu_seqlens[p+1]`` from and to ``ssm_pool[state_slots[p]]`` (``[S, H, P,
    N]``); snapshot ``j`` (after ``snap_offsets[j]`` rows of segment ``snap_seqs[j]``, 1 <= offset
    <= its length) into ``ssm_pool[snap_slots[j]]``. Index tensors are int32 or int64 on x's
    device (snapshot ones may be empty). Returns ``y [Tp, H, P]`` in fp32."""
    return _launch_prefill(
        x, dt, A, B, C, D, ssm_pool, cu_seqlens, state_slots, snap_seqs, snap_offsets, snap_slots
    )


def _launch_prefill(
    x, dt, A, B, C, D, ssm_pool, cu_seqlens, state_slots, snap_seqs, snap_offsets, snap_slots,
    chunk: int = CHUNK, block_p: int = PREFILL_BLOCK_P, num_warps: int = PREFILL_WARPS,
) -> torch.Tensor:  # fmt: skip
    """``mamba2_prefill`` with its tuning knobs (not yet tuned on a GPU)."""
    H, P, G, N = _shapes(x, B, ssm_pool)
    num_tokens, num_segs = x.shape[0], cu_seqlens.shape[0] - 1
    y = torch.empty((num_tokens, H, P), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_segs == 0:
        return y
    num_snaps = snap_seqs.shape[0]
    exact_inputs = B.dtype == C.dtype != torch.float32  # bf16 and fp16 values are exact in TF32
    _mamba2_prefill_kernel[(num_segs, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else A, ssm_pool, y, cu_seqlens, state_slots,
        snap_seqs, snap_offsets, snap_slots, num_snaps,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_pool.stride(), *y.stride(),
        HEADS_PER_GROUP=H // G, P=P, N=N, HAS_D=D is not None, BLOCK_P=block_p,
        BLOCK_N=max(32, triton.next_power_of_2(N)),
        SNAP_BLOCK=max(2, triton.next_power_of_2(num_snaps)), L=chunk,
        CB_DOT="tf32" if exact_inputs else FP32_DOT, FP32_DOT=FP32_DOT, num_warps=num_warps,
    )  # fmt: skip
    return y


def mamba2_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One step per request: ``x [B, H, P]``, ``dt [B, H]``, ``B, C [B, G, N]`` (any strides);
    request ``i``'s state ``ssm_pool[state_slots[i]]`` updated in place (slots distinct).
    With ``cu`` and ``row_slots`` (a verify step's decodes of several positions), request ``i``
    is rows ``cu[i]:cu[i + 1]`` and the state after row ``r`` goes into ``row_slots[r]`` (its
    working slot after its last row), each position starting from the state the one before
    stored, in the pool's dtype, as one-position steps would. Returns ``y [rows, H, P]`` in
    fp32. Decode snapshots no row writes are the caller's copy afterwards."""
    H, P, G, N = _shapes(x, B, ssm_pool)
    rows, requests = x.shape[0], state_slots.shape[0]
    y = torch.empty((rows, H, P), dtype=torch.float32, device=x.device)
    if rows == 0:
        return y
    multi = cu is not None
    block_p = min(DECODE_BLOCK_P, triton.next_power_of_2(P))
    _mamba2_decode_kernel[(requests, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else A, ssm_pool, y, state_slots,
        cu if multi else state_slots, row_slots if multi else state_slots,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_pool.stride(), *y.stride(),
        HEADS_PER_GROUP=H // G, P=P, N=N, HAS_D=D is not None, BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(N), MULTI=multi,
    )  # fmt: skip
    return y
