"""The Mamba2 selective scan as Triton kernels, over SSM states pooled by slot.

Semantics are the reference's (``kernels/mamba2.py``, ``TorchBackend.mamba2_prefill`` /
``mamba2_decode``): per head ``h`` (group ``h // (H // G)``), ``s_t = exp(dt_t A) s_{t-1} +
dt_t x_t B_t^T`` and ``y_t = s_t C_t + D x_t``; every product in fp32, the state ``[P, N]`` kept in
fp32 and stored in the pool's dtype (a bf16 pool rounds each state it stores, never the running
one), ``y`` returned in fp32.

Prefill design: one program per (segment, head, block of P) owns its ``[BLOCK_P, N]`` state in
registers for the whole segment and walks it chunk by chunk, sequentially; inside a chunk of
``L`` tokens it runs the chunked (SSD) form as four small matrix products::

    y     = (C B^T * decay) (dt x)  +  exp(cumsum a) * (C s^T)        + D x     a = dt A
    s_new = exp(sum a) s  +  (dt x * exp(a after each token))^T B

A chunk ends early at any snapshot offset of its segment, so the state there is exact and
snapshots fall at any offset, as the reference's pieces do. Against a token-by-token scan (exact,
simplest) this trades a little arithmetic (C B^T again for every block of P) for what a GPU
needs: one coalesced ``[L, N]`` load of B and C rows and four tensor-core products per chunk,
instead of a dependent load and cross-thread reduction per token. Against the fully parallel
SSD (chunk states in parallel, a state-passing pass, outputs in parallel: mamba_ssm's five
kernels) it keeps one launch and no intermediate buffers, but parallelism is only segments x
heads x P blocks and the chunks of a segment run in sequence: a lone long prefill on a model
with few heads (Granite-4.0-H-350M: 24) fills a fraction of the GPU.

Precision: the decays within a chunk are exponentials of segment sums taken by a cumulative
sum over a masked ``[L, L]`` tile (each ``sum_{j<k<=i} a_k`` summed on its own, never the
difference of two large prefix sums, which the reference avoids with float64). Products of
fp32 operands use ``tf32x3`` (three TF32 passes, about fp32 accuracy); ``C B^T`` of bf16 inputs
uses one TF32 pass, exact for bf16 values. Decode: one program per (request, head, block of P)
updates its state tile in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32  # tokens per chunk of the prefill scan
TARGET_PROGRAMS = 264  # prefill: halve BLOCK_P (down to 16) while fewer programs than this
DECODE_BLOCK_P = 32
FP32_DOT = "tf32x3"


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
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < P, n < N
    start = tl.load(cu_ptr + seg)
    end = tl.load(cu_ptr + seg + 1)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    state_offs = h * sp_h + p[:, None] * sp_p + n[None, :] * sp_n
    state_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(pool_ptr + slot * sp_s + state_offs, mask=state_mask, other=0.0)
    state = state.to(tl.float32)
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
        dt = tl.load(dt_ptr + t64 * sdt_t + h * sdt_h, mask=t_mask, other=0.0).to(tl.float32)
        x = tl.load(
            x_ptr + t64[:, None] * sx_t + h * sx_h + p[None, :] * sx_p,
            mask=t_mask[:, None] & p_mask[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        tn_mask = t_mask[:, None] & n_mask[None, :]
        Bc = tl.load(B_ptr + t64[:, None] * sb_t + g * sb_g + n[None, :] * sb_n, mask=tn_mask)
        Cc = tl.load(C_ptr + t64[:, None] * sc_t + g * sc_g + n[None, :] * sc_n, mask=tn_mask)
        Bc, Cc = Bc.to(tl.float32), Cc.to(tl.float32)
        a = dt * a_h  # padded rows: a = 0, x = B = C = 0 (decay 1, no input)
        # seg[i, k] = sum of a over (k, i]: a cumulative sum of its own per column
        seg_sum = tl.cumsum(tl.where(r[:, None] > r[None, :], a[:, None], 0.0), axis=0)
        decay = tl.where(causal, tl.exp(seg_sum), 0.0)
        xdt = x * dt[:, None]
        cb = tl.dot(Cc, tl.trans(Bc), input_precision=CB_DOT)
        y = tl.dot(cb * decay, xdt, input_precision=FP32_DOT)
        c_s = tl.dot(Cc, tl.trans(state), input_precision=FP32_DOT)
        y += tl.exp(tl.cumsum(a, axis=0))[:, None] * c_s
        if HAS_D:
            y += x * tl.load(D_ptr + h).to(tl.float32)
        tl.store(
            y_ptr + t64[:, None] * sy_t + h * sy_h + p[None, :] * sy_p, y,
            mask=t_mask[:, None] & p_mask[None, :],
        )  # fmt: skip
        after = tl.cumsum(a, axis=0, reverse=True) - a  # sum of a after each row
        weighted = xdt * tl.exp(after)[:, None]
        state = state * tl.exp(tl.sum(a, axis=0)) + tl.dot(
            tl.trans(weighted), Bc, input_precision=FP32_DOT
        )
        if tl.sum((cuts == stop).to(tl.int32), axis=0) > 0:
            for k in range(num_snaps):
                hit = (tl.load(snap_seqs_ptr + k) == seg) & (
                    start + tl.load(snap_offsets_ptr + k) == stop
                )
                dst = tl.load(snap_slots_ptr + k).to(tl.int64)
                tl.store(
                    pool_ptr + dst * sp_s + state_offs, state.to(pool_ptr.dtype.element_ty),
                    mask=state_mask & hit,
                )  # fmt: skip
        pos = stop
    tl.store(
        pool_ptr + slot * sp_s + state_offs, state.to(pool_ptr.dtype.element_ty), mask=state_mask
    )


@triton.jit
def _mamba2_decode_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, pool_ptr, y_ptr, slots_ptr,
    sx_b, sx_h, sx_p, sdt_b, sdt_h, sb_b, sb_g, sb_n, sc_b, sc_g, sc_n,
    sp_s, sp_h, sp_p, sp_n, sy_b, sy_h, sy_p,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0), tl.program_id(1)
    g = h // HEADS_PER_GROUP
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask, n_mask = p < P, n < N
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state_ptrs = pool_ptr + slot * sp_s + h * sp_h + p[:, None] * sp_p + n[None, :] * sp_n
    state_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * sx_b + h * sx_h + p * sx_p, mask=p_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * sdt_b + h * sdt_h).to(tl.float32)
    Bv = tl.load(B_ptr + b * sb_b + g * sb_g + n * sb_n, mask=n_mask, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * sc_b + g * sc_g + n * sc_n, mask=n_mask, other=0.0).to(tl.float32)
    decay = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    state = state * decay + (x * dt)[:, None] * Bv[None, :]
    y = tl.sum(state * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + h).to(tl.float32)
    tl.store(y_ptr + b * sy_b + h * sy_h + p * sy_p, y, mask=p_mask)
    tl.store(state_ptrs, state.to(pool_ptr.dtype.element_ty), mask=state_mask)


def _shapes(x: torch.Tensor, B: torch.Tensor, ssm_pool: torch.Tensor) -> tuple[int, int, int, int]:
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G or ssm_pool.shape[1:] != (H, P, N):
        raise ValueError(
            f"Mamba2 shapes disagree: x {tuple(x.shape)}, B {tuple(B.shape)}, pool "
            f"{tuple(ssm_pool.shape)} (want H divisible by G and a pool of [S, H, P, N])"
        )
    return H, P, G, N


def _block_p(P: int, programs_per_block: int) -> int:
    """The widest block of P (16 to 64) that still gives ``TARGET_PROGRAMS`` programs."""
    block = min(64, max(16, triton.next_power_of_2(P)))
    while block > 16 and programs_per_block * triton.cdiv(P, block) < TARGET_PROGRAMS:
        block //= 2
    return block


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
    chunk: int = CHUNK, block_p: int | None = None, num_warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """``mamba2_prefill`` with its tuning knobs (the device benchmark sweeps them)."""
    H, P, G, N = _shapes(x, B, ssm_pool)
    num_tokens, num_segs = x.shape[0], cu_seqlens.shape[0] - 1
    y = torch.empty((num_tokens, H, P), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_segs == 0:
        return y
    block_p = block_p or _block_p(P, num_segs * H)
    num_snaps = snap_seqs.shape[0]
    exact_inputs = B.dtype == C.dtype == torch.bfloat16  # bf16 values are exact in TF32
    _mamba2_prefill_kernel[(num_segs, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else A, ssm_pool, y, cu_seqlens, state_slots,
        snap_seqs, snap_offsets, snap_slots, num_snaps,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_pool.stride(), *y.stride(),
        HEADS_PER_GROUP=H // G, P=P, N=N, HAS_D=D is not None, BLOCK_P=block_p,
        BLOCK_N=max(16, triton.next_power_of_2(N)),
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
) -> torch.Tensor:
    """One step per request: ``x [B, H, P]``, ``dt [B, H]``, ``B, C [B, G, N]`` (any strides);
    request ``i``'s state ``ssm_pool[state_slots[i]]`` updated in place (slots distinct).
    Returns ``y [B, H, P]`` in fp32. Decode snapshots are the caller's copy afterwards."""
    H, P, G, N = _shapes(x, B, ssm_pool)
    batch = x.shape[0]
    y = torch.empty((batch, H, P), dtype=torch.float32, device=x.device)
    if batch == 0:
        return y
    block_p = min(DECODE_BLOCK_P, triton.next_power_of_2(P))
    _mamba2_decode_kernel[(batch, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else A, ssm_pool, y, state_slots,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *ssm_pool.stride(), *y.stride(),
        HEADS_PER_GROUP=H // G, P=P, N=N, HAS_D=D is not None, BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(N),
    )  # fmt: skip
    return y
