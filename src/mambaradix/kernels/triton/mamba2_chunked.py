"""The Mamba2 prefill in its fully parallel (SSD) form, the ``cuda`` backend's choice for
forwards of few long segments (``prefers_chunked``); semantics, precision and the sequential
form it complements: ``mamba2.py``.

Chunks of 64 new tokens of a segment, numbered as fla-core numbers them for the Gated DeltaNet
(``gdn.GdnChunks``: ``chunk_indices`` [NT, 2] of (segment, chunk within it), ``chunk_offsets``
[segments + 1]), in three launches::

    1. _mamba2_chunk_state_kernel  (chunk, head, block of P), every chunk at once: the chunk's
                                   own state from zero, B^T (dt x * exp(sum of a after each
                                   row)), and its sum of a
    2. _mamba2_pass_kernel         (segment, head, block of P), chunk after chunk: s =
                                   exp(sum a) s + own, each chunk's own state replaced by the
                                   state it starts from (elementwise only); the final state into
                                   the pool
    3. _mamba2_chunk_out_kernel    (chunk, head, block of P), every chunk at once: the chunk's
                                   outputs from its start state, as the sequential kernel's
                                   chunk step

The start states are the snapshots inside a prefill (a multiple of 64 of a segment's new
tokens, the backend's snapshot stride); ``states[NT + p]`` is segment ``p``'s final state.
Scratch: ``[NT + segments, H, P, N]`` fp32 (mamba_ssm keeps the same per-chunk states) and
``[NT, H]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaradix.kernels.triton.mamba2 import FP32_DOT, PREFILL_BLOCK_P, _rows, _shapes

CHUNKED_L = 64  # fla-core's chunk, so snapshots fall on chunk starts
CHUNKED_BLOCK_P = 32
CHUNKED_BLOCK_N = 32
# the most fp32 chunk-state scratch a forward may take (one 8k-token prompt of
# Granite-4.0-H-350M: 100 MB; of Nemotron-H-8B: 537 MB, which takes the sequential form)
CHUNKED_SCRATCH_BYTES = 256 << 20


@triton.jit
def _chunk_rows(chunk_ptr, cu_ptr, c, L: tl.constexpr):
    """Chunk ``c``'s packed rows ``start + arange(L)`` and the mask of those before its end."""
    seg = tl.load(chunk_ptr + 2 * c)
    start = tl.load(cu_ptr + seg) + tl.load(chunk_ptr + 2 * c + 1) * L
    end = tl.minimum(start + L, tl.load(cu_ptr + seg + 1))
    t = start + tl.arange(0, L)
    return t.to(tl.int64), t < end


@triton.jit
def _chunk_inputs(x_ptr, dt_ptr, A_ptr, chunk_ptr, cu_ptr, sx_t, sx_h, sx_p, sdt_t, sdt_h,
                  HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr,
                  L: tl.constexpr):  # fmt: skip
    """A (chunk, head, block of P) program's indices and fp32 inputs: chunk ``c``, head ``h``,
    its group ``g``, the block ``p`` and its mask, the chunk's rows ``t`` and their mask, and
    ``dt``, ``a = dt A`` ([L]) and ``x`` ([L, BLOCK_P]), 0 on padded rows (a = 0, x = 0)."""
    c, h = tl.program_id(0), tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = p < P
    t, t_mask = _chunk_rows(chunk_ptr, cu_ptr, c, L)
    dt = tl.load(dt_ptr + t * sdt_t + h * sdt_h, mask=t_mask, other=0.0).to(tl.float32)
    a = dt * tl.load(A_ptr + h).to(tl.float32)
    x_ptrs = x_ptr + t[:, None] * sx_t + h * sx_h + p[None, :] * sx_p
    x = tl.load(x_ptrs, mask=t_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
    return c, h, h // HEADS_PER_GROUP, p, p_mask, t, t_mask, dt, a, x


@triton.jit
def _mamba2_chunk_state_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, st_ptr, asum_ptr, chunk_ptr, cu_ptr,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, ss_c, ss_h, ss_p, ss_n,
    H: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, L: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    c, h, g, p, p_mask, t, t_mask, dt, a, x = _chunk_inputs(
        x_ptr, dt_ptr, A_ptr, chunk_ptr, cu_ptr, sx_t, sx_h, sx_p, sdt_t, sdt_h,
        HEADS_PER_GROUP, P, BLOCK_P, L,
    )  # fmt: skip
    after = tl.cumsum(a, axis=0, reverse=True) - a
    weighted = tl.trans(x * (dt * tl.exp(after))[:, None])  # [BLOCK_P, L]
    st = st_ptr + c.to(tl.int64) * ss_c + h * ss_h + p[:, None] * ss_p
    for nb in tl.static_range(0, N, BLOCK_N):
        n = nb + tl.arange(0, BLOCK_N)
        n_mask = n < N
        B_t = _rows(B_ptr + t[:, None] * sb_t + g * sb_g, t_mask, n, n_mask, sb_n)
        own = tl.dot(weighted, B_t, input_precision=FP32_DOT)  # [BLOCK_P, BLOCK_N]
        tl.store(st + n[None, :] * ss_n, own, mask=p_mask[:, None] & n_mask[None, :])
    tl.store(asum_ptr + c * H + h, tl.sum(a, axis=0), mask=tl.program_id(2) == 0)


@triton.jit
def _mamba2_pass_kernel(
    st_ptr, asum_ptr, pool_ptr, offsets_ptr, slots_ptr, num_chunks,
    ss_c, ss_h, ss_p, ss_n, sp_s, sp_h, sp_p, sp_n,
    H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    seg, h = tl.program_id(0), tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    mask = (p < P)[:, None] & (n < N)[None, :]
    tile = h * ss_h + p[:, None] * ss_p + n[None, :] * ss_n
    pool_tile = pool_ptr + tl.load(slots_ptr + seg).to(tl.int64) * sp_s + h * sp_h
    pool_tile += p[:, None] * sp_p + n[None, :] * sp_n
    s = tl.load(pool_tile, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(offsets_ptr + seg)
    last = tl.load(offsets_ptr + seg + 1)
    while c < last:
        ptrs = st_ptr + c.to(tl.int64) * ss_c + tile
        own = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, s, mask=mask)  # the state chunk c starts from
        s = s * tl.exp(tl.load(asum_ptr + c * H + h)) + own
        c += 1
    tl.store(st_ptr + (num_chunks + seg).to(tl.int64) * ss_c + tile, s, mask=mask)
    tl.store(pool_tile, s.to(pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mamba2_chunk_out_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, st_ptr, y_ptr, chunk_ptr, cu_ptr,
    sx_t, sx_h, sx_p, sdt_t, sdt_h, sb_t, sb_g, sb_n, sc_t, sc_g, sc_n, ss_c, ss_h, ss_p, ss_n,
    sy_t, sy_h, sy_p,
    HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, HAS_D: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, L: tl.constexpr, CB_DOT: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    c, h, g, p, p_mask, t, t_mask, dt, a, x = _chunk_inputs(
        x_ptr, dt_ptr, A_ptr, chunk_ptr, cu_ptr, sx_t, sx_h, sx_p, sdt_t, sdt_h,
        HEADS_PER_GROUP, P, BLOCK_P, L,
    )  # fmt: skip
    tp_mask = t_mask[:, None] & p_mask[None, :]
    st = st_ptr + c.to(tl.int64) * ss_c + h * ss_h + p[None, :] * ss_p
    cb = tl.zeros((L, L), dtype=tl.float32)
    c_s = tl.zeros((L, BLOCK_P), dtype=tl.float32)
    for nb in tl.static_range(0, N, BLOCK_N):
        n = nb + tl.arange(0, BLOCK_N)
        n_mask = n < N
        C_t = _rows(C_ptr + t[:, None] * sc_t + g * sc_g, t_mask, n, n_mask, sc_n)
        B_t = _rows(B_ptr + t[:, None] * sb_t + g * sb_g, t_mask, n, n_mask, sb_n)
        cb = tl.dot(C_t, tl.trans(B_t), cb, input_precision=CB_DOT)
        s = tl.load(st + n[:, None] * ss_n, mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        c_s = tl.dot(C_t, s, c_s, input_precision=FP32_DOT)
    r = tl.arange(0, L)
    seg_sum = tl.cumsum(tl.where(r[:, None] > r[None, :], a[:, None], 0.0), axis=0)
    decay = tl.where(r[:, None] >= r[None, :], tl.exp(seg_sum), 0.0)
    y = tl.dot(cb * decay, x * dt[:, None], input_precision=FP32_DOT)
    y += tl.exp(tl.cumsum(a, axis=0))[:, None] * c_s
    if HAS_D:
        y += x * tl.load(D_ptr + h).to(tl.float32)
    tl.store(y_ptr + t[:, None] * sy_t + h * sy_h + p[None, :] * sy_p, y, mask=tp_mask)


def prefers_chunked(
    num_segs: int, num_chunks: int, H: int, P: int, N: int, multiprocessors: int
) -> bool:
    """Whether a prefill should take the fully parallel form: the sequential kernel's programs
    (segments x heads x blocks of P) would leave the GPU's multiprocessors short of work (under
    four programs each) while its segments are long enough (four chunks of 64 on average) to
    walk many chunks in sequence, and the chunk states it keeps fit ``CHUNKED_SCRATCH_BYTES``
    (models with many heads fill the GPU with the sequential kernel anyway). Host integers
    only. Not yet tuned on a GPU: the device benchmark times both forms (``bench_gpu.py``)."""
    programs = num_segs * H * triton.cdiv(P, PREFILL_BLOCK_P)
    scratch = (num_chunks + num_segs) * H * P * N * 4
    return (
        programs < 4 * multiprocessors
        and num_chunks >= 4 * num_segs
        and scratch <= CHUNKED_SCRATCH_BYTES
    )


def mamba2_prefill_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_slots: torch.Tensor,
    snap_chunks: torch.Tensor,
    snap_slots: torch.Tensor,
    chunk_indices: torch.Tensor,
    chunk_offsets: torch.Tensor,
    block_p: int = CHUNKED_BLOCK_P,
    block_n: int = CHUNKED_BLOCK_N,
) -> torch.Tensor:
    """``mamba2_prefill`` in the fully parallel form (module docstring), for prefills
    whose segments are few and long. Chunks of ``CHUNKED_L`` rows: ``chunk_indices`` /
    ``chunk_offsets`` as fla-core's (``gdn.GdnChunks`` of the segments' lengths, built on the
    host). Snapshot ``j`` is the state its source ``snap_chunks[j]`` names (``gdn.snapshot_index``:
    a chunk's start state, or ``NT + p`` for segment ``p``'s final one), copied into
    ``ssm_pool[snap_slots[j]]``. Returns ``y [Tp, H, P]`` in fp32."""
    H, P, G, N = _shapes(x, B, ssm_pool)
    num_tokens, num_segs = x.shape[0], cu_seqlens.shape[0] - 1
    num_chunks = chunk_indices.shape[0]
    y = torch.empty((num_tokens, H, P), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_segs == 0:
        return y
    states = torch.empty((num_chunks + num_segs, H, P, N), dtype=torch.float32, device=x.device)
    asum = torch.empty((num_chunks, H), dtype=torch.float32, device=x.device)
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))
    exact_inputs = B.dtype == C.dtype != torch.float32
    common = dict(HEADS_PER_GROUP=H // G, P=P, N=N, BLOCK_P=block_p, BLOCK_N=block_n,
                  L=CHUNKED_L, FP32_DOT=FP32_DOT)  # fmt: skip
    p_blocks = triton.cdiv(P, block_p)
    _mamba2_chunk_state_kernel[(num_chunks, H, p_blocks)](
        x, dt, A, B, states, asum, chunk_indices, cu_seqlens,
        *x.stride(), *dt.stride(), *B.stride(), *states.stride(), H=H, **common,
    )  # fmt: skip
    _mamba2_pass_kernel[(num_segs, H, p_blocks)](
        states, asum, ssm_pool, chunk_offsets, state_slots, num_chunks,
        *states.stride(), *ssm_pool.stride(), H=H, P=P, N=N, BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(N),
    )  # fmt: skip
    _mamba2_chunk_out_kernel[(num_chunks, H, p_blocks)](
        x, dt, A, B, C, D if D is not None else A, states, y, chunk_indices, cu_seqlens,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *states.stride(), *y.stride(),
        HAS_D=D is not None, CB_DOT="tf32" if exact_inputs else FP32_DOT, **common,
    )  # fmt: skip
    if snap_slots.shape[0]:
        picked = states.index_select(0, snap_chunks.to(torch.long))
        ssm_pool.index_copy_(0, snap_slots.to(torch.long), picked.to(ssm_pool.dtype))
    return y
