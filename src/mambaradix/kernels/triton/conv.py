"""The short causal depthwise conv as Triton kernels, over conv states pooled by slot.

The semantics are the reference's (``kernels/conv.py``, ``TorchBackend.conv1d_prefill`` /
``conv1d_decode``): token-major activations ``[T, C]``, weight ``[C, K]``, a state ``[C, K-1]``
holding the last ``K-1`` inputs, oldest first, in ``conv_pool[slot]``. As in the reference, a
carried-in state and the weight are rounded to the activations' dtype before use and states are
stored in the pool's dtype; the sum, bias and activation run in fp32, rounded once to the
output's dtype (the reference rounds after the conv and again after the activation in bf16).

Prefill is two launches, stream-ordered, so no program overwrites a state another still reads::

    _conv_prefill_kernel   grid (token blocks of the packed rows, channel blocks): the rows at
                           least K-1 into their segment (found by a binary search of
                           cu_seqlens), whose K taps all read rows of the same segment
    _conv_states_kernel    grid (segments, channel blocks): the segment's first K-1 rows, whose
                           taps reach into its carried-in state; every snapshot's state; then,
                           past a barrier, the final state into the segment's own slot

Keeping the pool out of the token-block kernel keeps its gathers (a state's channels lie K-1
apart) off the hot path: that kernel streams x at full width.

Decode is one launch, grid (requests, channel blocks), the state updated in place. No function
reads device data from Python: grids come from tensor shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16  # packed rows per prefill program
BLOCK_C = 128  # channels per program (256 bytes of bf16 per row)


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, cu_ptr, num_tokens, num_segs, channels,
    sx_t, sx_c, sw_c, sw_k, so_t, so_c,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask, c_mask = t < num_tokens, c < channels
    # each row's segment: the last p with cu_seqlens[p] <= t (empty segments are skipped)
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (num_segs - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(cu_ptr + mid) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    body = t_mask & (t - tl.load(cu_ptr + lo) >= K - 1)  # the segment's first K-1: elsewhere
    mask = body[:, None] & c_mask[None, :]
    x_ty = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(K):
        src = (t - (K - 1) + k).to(tl.int64)  # the row tap k reads
        xv = tl.load(x_ptr + src[:, None] * sx_t + c[None, :] * sx_c, mask=mask, other=0.0)
        w = tl.load(w_ptr + c * sw_c + k * sw_k, mask=c_mask, other=0.0)
        acc += xv.to(tl.float32) * w.to(x_ty).to(tl.float32)[None, :]
    acc = _finish(acc, bias_ptr, c, c_mask, HAS_BIAS, SILU)
    out_ptrs = out_ptr + t.to(tl.int64)[:, None] * so_t + c[None, :] * so_c
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _finish(acc, bias_ptr, c, c_mask, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """Bias and activation on a ``[rows, BLOCK_C]`` fp32 tile."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _window(
    x_ptr, state_ptr, start, n, c, mask, sx_t, sx_c, sp_c, sp_k, i,
    OFFSET: tl.constexpr, K: tl.constexpr,
):  # fmt: skip
    """``[len(i), BLOCK_C]`` fp32: row ``i`` holds the input ``n - (K-1) + i + OFFSET`` of the
    segment starting at packed row ``start`` (a negative one: a column of its carried-in state
    ``state_ptr``, rounded to x's dtype as the reference does)."""
    pos = n - (K - 1) + i + OFFSET
    from_x = (pos >= 0)[:, None]
    xv = tl.load(
        x_ptr + (start + pos).to(tl.int64)[:, None] * sx_t + c[None, :] * sx_c,
        mask=mask & from_x, other=0.0,
    )  # fmt: skip
    sv = tl.load(
        state_ptr + c[None, :] * sp_c + (K - 1 + pos)[:, None] * sp_k,
        mask=mask & (pos < 0)[:, None], other=0.0,
    )  # fmt: skip
    sv = sv.to(tl.float32).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.where(from_x, xv.to(tl.float32), sv)


@triton.jit
def _conv_states_kernel(
    x_ptr, w_ptr, bias_ptr, pool_ptr, out_ptr, cu_ptr, slots_ptr,
    snap_seqs_ptr, snap_offsets_ptr, snap_slots_ptr, num_snaps, channels,
    sx_t, sx_c, sw_c, sw_k, sp_s, sp_c, sp_k, so_t, so_c,
    K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < channels
    start = tl.load(cu_ptr + seg)
    length = tl.load(cu_ptr + seg + 1) - start
    state_ptr = pool_ptr + tl.load(slots_ptr + seg).to(tl.int64) * sp_s
    i = tl.arange(0, KP)
    x_ty = x_ptr.dtype.element_ty
    # the outputs of the segment's first K-1 rows: tap k of row i reads input i - (K-1) + k
    head = (i < K - 1) & (i < length)
    head_mask = head[:, None] & c_mask[None, :]
    acc = tl.zeros([KP, BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(K):
        v = _window(x_ptr, state_ptr, start, 0, c, head_mask, sx_t, sx_c, sp_c, sp_k, i, k, K)
        w = tl.load(w_ptr + c * sw_c + k * sw_k, mask=c_mask, other=0.0)
        acc += v * w.to(x_ty).to(tl.float32)[None, :]
    acc = _finish(acc, bias_ptr, c, c_mask, HAS_BIAS, SILU)
    out_ptrs = out_ptr + (start + i).to(tl.int64)[:, None] * so_t + c[None, :] * so_c
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=head_mask)
    # the states: row i of a state tile is its column i (transposed: channels stay contiguous)
    state_mask = (i < K - 1)[:, None] & c_mask[None, :]
    state_offs = c[None, :] * sp_c + i[:, None] * sp_k
    for j in range(num_snaps):
        mine = tl.load(snap_seqs_ptr + j) == seg
        n = tl.load(snap_offsets_ptr + j)
        dst = pool_ptr + tl.load(snap_slots_ptr + j).to(tl.int64) * sp_s
        snap = _window(
            x_ptr, state_ptr, start, n, c, state_mask & mine, sx_t, sx_c, sp_c, sp_k, i, 0, K
        )
        tl.store(dst + state_offs, snap.to(pool_ptr.dtype.element_ty), mask=state_mask & mine)
    final = _window(x_ptr, state_ptr, start, length, c, state_mask, sx_t, sx_c, sp_c, sp_k, i, 0, K)
    tl.debug_barrier()  # every thread has read the carried-in state before any overwrites it
    tl.store(state_ptr + state_offs, final.to(pool_ptr.dtype.element_ty), mask=state_mask)


@triton.jit
def request_rows(cu_ptr, req, MULTI: tl.constexpr):
    """A decode request's rows ``[first, end)``: its own row, or (``MULTI``: decodes of several
    positions) ``cu[req]:cu[req + 1]``."""
    if MULTI:
        first = tl.load(cu_ptr + req)
        end = tl.load(cu_ptr + req + 1)
    else:
        first = req
        end = req + 1
    return first, end


@triton.jit
def row_slot(row_slots_ptr, row, slot, MULTI: tl.constexpr):
    """The pool slot of the state after decode row ``row`` (int64): its request's ``slot``, or
    (``MULTI``) ``row_slots[row]``."""
    if MULTI:
        dst = tl.load(row_slots_ptr + row).to(tl.int64)
    else:
        dst = slot
    return dst


@triton.jit
def _conv_decode_kernel(
    x_ptr, w_ptr, bias_ptr, pool_ptr, out_ptr, slots_ptr, cu_ptr, row_slots_ptr, channels,
    sx_b, sx_c, sw_c, sw_k, sp_s, sp_c, sp_k, so_b, so_c,
    K: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_C: tl.constexpr, MULTI: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < channels
    slot = tl.load(slots_ptr + req).to(tl.int64)
    x_ty = x_ptr.dtype.element_ty
    k = tl.arange(0, KW)
    state_ptrs = pool_ptr + slot * sp_s + c[:, None] * sp_c
    w = tl.load(
        w_ptr + c[:, None] * sw_c + k[None, :] * sw_k,
        mask=c_mask[:, None] & (k < K)[None, :], other=0.0,
    )  # fmt: skip
    w = w.to(tl.float32).to(x_ty).to(tl.float32)
    # rows: one per request, or (MULTI: a verify step's) rows cu[req]:cu[req + 1]; row j of a
    # request reads the sequence [its carried-in state (K-1 columns) | its rows' inputs] at
    # j .. j+K-1, and the state after it is that sequence at j+1 .. j+K-1
    first, end = request_rows(cu_ptr, req, MULTI)
    b = first
    while b < end:
        window = _conv_sequence(x_ptr, state_ptrs, c, c_mask, b - first, first, b, sx_b, sx_c,
                                sp_k, pool_ptr, K, KW, K)  # fmt: skip
        acc = tl.sum(window * w, axis=1)
        acc = tl.sum(_finish(acc[None, :], bias_ptr, c, c_mask, HAS_BIAS, SILU), axis=0)
        tl.store(out_ptr + b * so_b + c * so_c, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
        new = _conv_sequence(x_ptr, state_ptrs, c, c_mask, b - first + 1, first, b, sx_b, sx_c,
                             sp_k, pool_ptr, K, KW, K - 1)  # fmt: skip
        dst = pool_ptr + row_slot(row_slots_ptr, b, slot, MULTI) * sp_s + c[:, None] * sp_c
        tl.debug_barrier()  # every thread has read the state before any overwrites it
        state_mask = c_mask[:, None] & (k < K - 1)[None, :]
        tl.store(dst + k[None, :] * sp_k, new.to(pool_ptr.dtype.element_ty), mask=state_mask)
        b += 1


@triton.jit
def _conv_sequence(x_ptr, state_ptrs, c, c_mask, j, first, current, sx_b, sx_c, sp_k, pool_ptr,
                   K: tl.constexpr, KW: tl.constexpr, COLS: tl.constexpr):  # fmt: skip
    """``[BLOCK_C, KW]`` fp32: columns ``j .. j+COLS-1`` of a request's sequence [carried-in
    state (K-1 columns, rounded to the activations' dtype) | its rows' inputs from row
    ``first``] as row ``current`` reads it, 0 in the columns past them."""
    k = tl.arange(0, KW)
    i = j + k
    from_state = (i < K - 1)[None, :]
    used = c_mask[:, None] & (k < COLS)[None, :]
    sv = tl.load(state_ptrs + i[None, :] * sp_k, mask=used & from_state, other=0.0)
    rows = (first + tl.maximum(i - (K - 1), 0)).to(tl.int64)
    xv = tl.load(x_ptr + rows[None, :] * sx_b + c[:, None] * sx_c, mask=used & ~from_state,
                 other=0.0)  # fmt: skip
    x_ty = x_ptr.dtype.element_ty
    # an earlier row's input reached this row through a stored state: in the pool's dtype
    stored = xv.to(pool_ptr.dtype.element_ty).to(x_ty)
    xv = tl.where((rows < current)[None, :], stored, xv).to(tl.float32)
    return tl.where(from_state, sv.to(tl.float32).to(x_ty).to(tl.float32), xv)


def _activation_is_silu(activation: str | None) -> bool:
    if activation is None or activation == "identity":
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported conv activation {activation!r} (use 'silu' or None)")


def _check_width(weight: torch.Tensor, conv_pool: torch.Tensor) -> int:
    C, K = weight.shape
    if K < 2 or conv_pool.shape[1:] != (C, K - 1):
        raise ValueError(
            f"conv weight {tuple(weight.shape)} needs K >= 2 and a pool of [S, {C}, {K - 1}], "
            f"got {tuple(conv_pool.shape)}"
        )
    return K


def conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    snap_seqs: torch.Tensor,
    snap_offsets: torch.Tensor,
    snap_slots: torch.Tensor,
    activation: str | None,
) -> torch.Tensor:
    """The causal conv over packed segments: ``x [Tp, C]`` (any strides), segment ``p`` rows
    ``cu_seqlens[p] : cu_seqlens[p+1]`` from the state in ``conv_pool[state_slots[p]]``
    (``[S, C, K-1]``), its final state written back there; snapshot ``j`` (the state after
    ``snap_offsets[j]`` rows of segment ``snap_seqs[j]``, 1 <= offset <= its length) into
    ``conv_pool[snap_slots[j]]``. Index tensors are int32 or int64 on x's device (snapshot ones
    may be empty). Returns ``[Tp, C]`` in x's dtype."""
    K = _check_width(weight, conv_pool)
    silu = _activation_is_silu(activation)
    num_tokens, channels = x.shape
    num_segs = cu_seqlens.shape[0] - 1
    out = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or num_segs == 0:
        return out
    c_blocks = triton.cdiv(channels, BLOCK_C)
    bias_arg = bias if bias is not None else x
    _conv_prefill_kernel[(triton.cdiv(num_tokens, BLOCK_T), c_blocks)](
        x, weight, bias_arg, out, cu_seqlens, num_tokens, num_segs, channels,
        *x.stride(), *weight.stride(), *out.stride(),
        K=K, HAS_BIAS=bias is not None, SILU=silu,
        SEARCH_STEPS=max(1, (num_segs - 1).bit_length()), BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    _conv_states_kernel[(num_segs, c_blocks)](
        x, weight, bias_arg, conv_pool, out, cu_seqlens, state_slots, snap_seqs, snap_offsets,
        snap_slots, snap_seqs.shape[0], channels,
        *x.stride(), *weight.stride(), *conv_pool.stride(), *out.stride(),
        K=K, KP=triton.next_power_of_2(K - 1), HAS_BIAS=bias is not None, SILU=silu,
        BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return out


def conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    state_slots: torch.Tensor,
    activation: str | None,
    cu: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One step per request: ``x [B, C]`` (any strides), request ``i``'s state
    ``conv_pool[state_slots[i]]`` updated in place (slots distinct). With ``cu`` and
    ``row_slots`` (a verify step's decodes of several positions), request ``i`` is rows
    ``cu[i]:cu[i + 1]`` and the state after row ``r`` goes into ``row_slots[r]`` (its working
    slot after its last row), each position reading what the one before stored, as
    one-position steps would. Returns ``[rows, C]`` in x's dtype. Decode snapshots no row
    writes are the caller's copy afterwards."""
    K = _check_width(weight, conv_pool)
    silu = _activation_is_silu(activation)
    rows, channels = x.shape
    out = torch.empty((rows, channels), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    multi = cu is not None
    _conv_decode_kernel[(state_slots.shape[0], triton.cdiv(channels, BLOCK_C))](
        x, weight, bias if bias is not None else x, conv_pool, out, state_slots,
        cu if multi else state_slots, row_slots if multi else state_slots, channels,
        *x.stride(), *weight.stride(), *conv_pool.stride(), *out.stride(),
        K=K, KW=triton.next_power_of_2(K), HAS_BIAS=bias is not None, SILU=silu,
        BLOCK_C=BLOCK_C, MULTI=multi,
    )  # fmt: skip
    return out
