"""Gated DeltaNet on fla-core's Triton kernels: the ``cuda`` backend's delta-rule prefill and
decode step (the conv and the gates are the backend's; see ``kernels/gated_delta.py`` for the
reference these match).

Conventions, as the reference: ``q``, ``k`` are L2-normalised inside (``x / sqrt(sum x^2 + 1e-6)``)
and ``q`` is scaled by ``Dk**-0.5``; ``g`` is the log decay (the state is multiplied by
``exp(g)``) and ``beta`` the write strength after its sigmoid; value head ``h`` reads key head
``h // (Hv // Hk)``; a pool row is one request's ``[Hv, Dk, Dv]`` state (fla's ``[N, HV, K, V]``
layout), fp32 or bf16.

Prefill runs the stages of fla-core's chunked forward
(``fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_fwd``, fla-core==0.6.0) one by one, so
that the chunk-boundary states its state-passing kernel writes can be read::

    segment p    |<---- chunk c ---->|<--- chunk c+1 --->|<- c+2 (part) ->|
    h[c]  = the state it starts from (its slot's)
    h[c+1] = after 64 new tokens,  h[c+2] = after 128,     final state -> ht[p]

A snapshot is addressed by one integer, its *source*: ``i < NT`` is ``h[i]`` (chunks numbered
across all segments in order, fla's varlen numbering; ``NT`` chunks in all), ``NT + p`` is the
final state of segment ``p`` (so a snapshot at a segment's end, of any length, needs no special
case). ``snapshot_index`` computes it on the host; ``GdnChunks`` carries the chunk numbering to
the device once per forward (fla would otherwise derive it from ``cu_seqlens`` with a host read).

Decode is one step of fla-core's KDA recurrent kernel (a per-key-channel decay: the GDN decay
repeated over the ``Dk`` channels is exactly the GDN step), which reads and writes pool rows by
slot index in place; fla-core 0.6.0's GDN recurrent kernel has no slot indices.

Precision: the kernels keep states in fp32 registers; the final states come out fp32 and land in
the pool's dtype. ``h`` is written in the activations' dtype by fla; when a forward has snapshots
and the pool is fp32 while the activations are bf16, ``h`` is written in fp32 instead (and a bf16
copy feeds the output kernel, as fla would have read it), so a snapshot is as exact as a final
state (on an H200, a Qwen3-Next layer's 8k-token prefill: 0.76-0.88 ms, 1.0-1.4 ms with fp32
``h``). On an Ampere-or-later GPU fla's ``tl.dot`` on fp32 operands runs in TF32: fp32 results
there are ~1e-3 of the largest value off the reference (the decode step has no dot: ~1e-7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from fla.modules.norm.l2norm import l2norm_fwd
from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64
from fla.ops.common.chunk_o import chunk_fwd_o
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices, prepare_chunk_offsets
from fla.ops.utils.constant import RCP_LN2
from torch import Tensor

from mambaradix.layout import to_device

CHUNK_SIZE = 64  # fla's chunk: snapshots inside a prefill fall on multiples of it
DECODE_BLOCK_V = 32  # values of Dv per program of the multi-position decode


def _num_chunks(n: int) -> int:
    return -(-n // CHUNK_SIZE)


def snapshot_index(seg_lens: Sequence[int], seg: int, n: int) -> int:
    """The source (module docstring) of the state after ``n`` new tokens of segment ``seg``:
    ``n`` a multiple of ``CHUNK_SIZE`` below the segment's length (a chunk-boundary state), or the
    segment's length (its final state)."""
    length = seg_lens[seg]
    if n == length:
        return sum(_num_chunks(x) for x in seg_lens) + seg
    if not 0 <= n < length or n % CHUNK_SIZE:
        raise ValueError(
            f"snapshot after {n} of {length} tokens: only multiples of {CHUNK_SIZE} below the "
            "segment's length, or its length, can be taken (BackendCapabilities.snapshot_stride)"
        )
    return sum(_num_chunks(x) for x in seg_lens[:seg]) + n // CHUNK_SIZE


@dataclass(frozen=True, slots=True)
class GdnChunks:
    """fla's varlen chunk numbering of one prefill forward, built on the host from the segments'
    lengths (``build``, once per forward; the layers share it)."""

    indices: Tensor  # [NT, 2]: (segment, chunk within it) of each chunk (fla's chunk_indices)
    offsets: Tensor  # [N + 1]: each segment's first chunk (fla's chunk_offsets)

    @classmethod
    def build(cls, seg_lens: Sequence[int], device: torch.device | str) -> GdnChunks:
        counts = [_num_chunks(n) for n in seg_lens]
        pairs = [(p, c) for p, count in enumerate(counts) for c in range(count)]
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        return cls(
            indices=to_device(torch.tensor(pairs, dtype=torch.int32), device).view(-1, 2),
            offsets=to_device(torch.tensor(offsets, dtype=torch.int32), device),
        )


def gdn_prefill(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_pool: Tensor,
    cu_seqlens: Tensor,
    state_slots: Tensor,
    snap_chunks: Tensor,
    snap_slots: Tensor,
    chunks: GdnChunks | None = None,
) -> Tensor:
    """The delta rule over the packed prefill segments.

    q, k ``[Tp, Hk, Dk]`` (not normalised); v ``[Tp, Hv, Dv]``; g, beta ``[Tp, Hv]``; ssm_pool
    ``[S, Hv, Dk, Dv]``; segment ``p`` is rows ``cu_seqlens[p]:cu_seqlens[p + 1]`` (int32 or int64
    on the device), starts from ``ssm_pool[state_slots[p]]`` and leaves its final state there;
    snapshot ``j`` writes the state its source ``snap_chunks[j]`` (``snapshot_index``) names into
    ``ssm_pool[snap_slots[j]]``. ``chunks`` (``GdnChunks.build`` over the segments' lengths)
    spares a host read of ``cu_seqlens``. Returns o ``[Tp, Hv, Dv]`` in v's dtype.
    """
    if chunks is None:  # fla derives them with a host read of cu_seqlens
        chunks = GdnChunks(
            prepare_chunk_indices(cu_seqlens, CHUNK_SIZE),
            prepare_chunk_offsets(cu_seqlens, CHUNK_SIZE),
        )
    num_chunks = chunks.indices.shape[0]
    chunking = {"cu_seqlens": cu_seqlens, "chunk_indices": chunks.indices, "chunk_size": CHUNK_SIZE}
    q, _ = l2norm_fwd(q.unsqueeze(0).contiguous())
    k, _ = l2norm_fwd(k.unsqueeze(0).contiguous())
    v, g, beta = (x.unsqueeze(0).contiguous() for x in (v, g, beta))
    g = chunk_local_cumsum(g, scale=RCP_LN2, **chunking)  # log2 of the decay in each chunk, fp32
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, **chunking)

    snapshots = snap_slots.shape[0] > 0
    state_dtype = torch.promote_types(k.dtype, ssm_pool.dtype) if snapshots else k.dtype
    h0 = ssm_pool.index_select(0, state_slots)
    h, v_new, final = _pass_states(k, w, u, g, h0, cu_seqlens, chunks, state_dtype, num_chunks)
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h.to(k.dtype), g=g, scale=k.shape[-1] ** -0.5, **chunking)

    if snapshots:
        flat = h[0]
        src = snap_chunks.to(torch.long)
        inside = (src < num_chunks).view(-1, 1, 1, 1)
        from_h = flat.index_select(0, src.clamp(max=max(num_chunks - 1, 0)))
        from_final = final.index_select(0, (src - num_chunks).clamp(min=0))
        states = torch.where(inside, from_h.to(final.dtype), from_final)
        ssm_pool.index_copy_(0, snap_slots, states.to(ssm_pool.dtype))
    ssm_pool.index_copy_(0, state_slots, final.to(ssm_pool.dtype))
    return o[0]


def _pass_states(
    k: Tensor,
    w: Tensor,
    u: Tensor,
    g: Tensor,
    h0: Tensor,
    cu_seqlens: Tensor,
    chunks: GdnChunks,
    state_dtype: torch.dtype,
    num_chunks: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """fla's state-passing kernel (``chunk_gated_delta_rule_fwd_h``'s launch, with ``h`` in
    ``state_dtype``): chunk-start states ``h [1, NT, Hv, Dk, Dv]``, the values it corrects
    ``v_new``, and the final states fp32 ``[N, Hv, Dk, Dv]``."""
    _, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    N = h0.shape[0]
    h = k.new_empty(1, num_chunks, HV, K, V, dtype=state_dtype)
    final = k.new_empty(N, HV, K, V, dtype=torch.float32)
    v_new = torch.empty_like(u)

    def grid(meta):
        return (triton.cdiv(V, meta["BV"]) * N * HV,)

    chunk_gated_delta_rule_fwd_kernel_h_blockdim64[grid](
        k=k,
        v=u,
        w=w,
        v_new=v_new,
        g=g,
        gk=None,
        h=h,
        h0=h0,
        ht=final,
        cu_seqlens=cu_seqlens,
        chunk_offsets=chunks.offsets,
        T=T,
        H=H,
        HV=HV,
        K=K,
        V=V,
        BT=CHUNK_SIZE,
        STATE_V_FIRST=False,
    )
    return h, v_new, final


def gdn_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_pool: Tensor,
    state_slots: Tensor,
) -> Tensor:
    """One delta-rule step for B requests, in place on their pool rows.

    q, k ``[B, Hk, Dk]`` (not normalised); v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``; ssm_pool
    ``[S, Hv, Dk, Dv]`` whose rows are contiguous; ``state_slots`` ``[B]`` distinct slots (none
    negative). Returns o ``[B, Hv, Dv]`` in v's dtype.
    """
    B, HV, _ = v.shape
    K = ssm_pool.shape[2]
    if ssm_pool.stride()[1:] != ssm_pool[0].contiguous().stride():
        raise ValueError("gdn_decode: the kernel indexes pool rows as contiguous [Hv, Dk, Dv]")
    gk = g.to(torch.float32).view(B, 1, HV, 1).expand(B, 1, HV, K).contiguous()
    o, _ = fused_recurrent_kda_fwd(
        q=q.unsqueeze(1).contiguous(),
        k=k.unsqueeze(1).contiguous(),
        v=v.unsqueeze(1).contiguous(),
        g=gk,
        beta=beta.unsqueeze(1).contiguous(),
        scale=K**-0.5,
        initial_state=ssm_pool,
        inplace_final_state=True,
        ssm_state_indices=state_slots,
        use_qk_l2norm_in_kernel=True,
    )
    return o[:, 0]


# --------------------------------------------------------------------------- several positions


@triton.jit
def _gdn_positions_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, pool_ptr, slots_ptr, cu_ptr, row_slots_ptr,
    sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, sg_t, sg_h, sb_t, sb_h,
    so_t, so_h, so_d, sp_s, sp_h, sp_k, sp_v, scale,
    HEADS_PER_KEY: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    req, h = tl.program_id(0), tl.program_id(1)
    hk = h // HEADS_PER_KEY
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = kk < DK, vv < DV
    mask = k_mask[:, None] & v_mask[None, :]
    tile = h * sp_h + kk[:, None] * sp_k + vv[None, :] * sp_v
    s = tl.load(pool_ptr + tl.load(slots_ptr + req).to(tl.int64) * sp_s + tile, mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    r = tl.load(cu_ptr + req)
    end = tl.load(cu_ptr + req + 1)
    while r < end:
        r64 = r.to(tl.int64)
        q = tl.load(q_ptr + r64 * sq_t + hk * sq_h + kk * sq_d, mask=k_mask, other=0.0)
        k = tl.load(k_ptr + r64 * sk_t + hk * sk_h + kk * sk_d, mask=k_mask, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + r64 * sv_t + h * sv_h + vv * sv_d, mask=v_mask, other=0.0)
        g = tl.load(g_ptr + r64 * sg_t + h * sg_h).to(tl.float32)
        beta = tl.load(beta_ptr + r64 * sb_t + h * sb_h).to(tl.float32)
        s = s * tl.exp(g)
        delta = (v.to(tl.float32) - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + r64 * so_t + h * so_h + vv * so_d, o.to(o_ptr.dtype.element_ty),
                 mask=v_mask)  # fmt: skip
        dst = pool_ptr + tl.load(row_slots_ptr + r).to(tl.int64) * sp_s
        s = s.to(pool_ptr.dtype.element_ty)
        tl.store(dst + tile, s, mask=mask)
        s = s.to(tl.float32)  # the next position starts from the stored state, as a step would
        r += 1


def gdn_decode_positions(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_pool: Tensor,
    state_slots: Tensor,
    cu: Tensor,
    row_slots: Tensor,
) -> Tensor:
    """The delta rule over decodes of several positions (a verify step), this project's kernel
    (fla-core 0.6.0's recurrent kernels write only a sequence's last state): request ``i`` is
    rows ``cu[i]:cu[i + 1]``, starts from ``ssm_pool[state_slots[i]]`` and writes the state
    after row ``r`` into ``ssm_pool[row_slots[r]]`` (its working slot after its last row). A
    program per (request, value head, block of Dv) keeps its state in registers across the
    request's rows. q, k ``[T, Hk, Dk]`` (not normalised); v ``[T, Hv, Dv]``; g, beta ``[T,
    Hv]``. Returns o ``[T, Hv, Dv]`` in v's dtype."""
    T, HV, DV = v.shape
    HK, DK = k.shape[1], k.shape[2]
    o = torch.empty_like(v)
    requests = state_slots.shape[0]
    if T == 0 or requests == 0:
        return o
    block_v = min(DECODE_BLOCK_V, triton.next_power_of_2(DV))
    _gdn_positions_kernel[(requests, HV, triton.cdiv(DV, block_v))](
        q, k, v, g, beta, o, ssm_pool, state_slots, cu, row_slots,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_pool.stride(), DK**-0.5, HEADS_PER_KEY=HV // HK, DK=DK, DV=DV,
        BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=block_v,
    )  # fmt: skip
    return o
