"""Paged attention over token-slot KV pools (Triton): the ``cuda`` backend's prefill and decode.

Pools are ``k_pool [S, Hkv, D]`` / ``v_pool [S, Hkv, Dv]``; a token's key and value live in row
``slot``, and a sequence's slots are one row of a slot table. Query head ``h`` reads KV head
``h // G`` (``G = Hq // Hkv``). Semantics are the reference's (``kernels/attention.py``): scores
``scale * q.k`` with q cast to the pools' dtype, softmax and the weighted sum accumulated in
fp32, the output in q's dtype.

One kernel serves both entry points. A program owns one KV head of one sequence and a block of
``BLOCK_M`` query rows, where a row is a (query, head-of-the-group) pair: the group's G heads of
one token are adjacent rows, so every K/V tile a program loads serves all G heads (GQA read
once), and a decode's G heads fill one block::

    rows of a block (G = 2):  q0.h0  q0.h1  q1.h0  q1.h1  ...
    keys of query i:          0 .. prefix + i          (causal, after ``prefix`` cached keys)

    key positions:  [ lo ............ full | diagonal ... hi )
                      every row sees these    masked per row

Splits (flash-decoding): the key range is cut into ``num_splits`` chunks of ``split_len`` keys;
each chunk's program writes its normalised partial output and log-sum-exp (base 2), and
``_merge_splits`` combines them. Splits are chosen from Python ints only (table width, batch,
heads), so the grid never depends on a device value and a decode can be captured in a CUDA
graph; a split past a sequence's length writes an empty part (lse -inf) that the merge ignores.
With one split the kernel writes the output directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 128  # a split reads at least this many keys (its fixed cost is the partial row)
MAX_SPLITS = 128
MERGE_CHUNK = 32  # splits the merge kernel reads per step


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    """Block sizes and launch options of the attention kernel. ``block_m``: query rows (query x
    group head) per program; ``block_n``: keys per step. Both powers of two, at least 16 (the
    tensor-core dot's minimum)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def prefill_tiles(head_dim: int, v_head_dim: int, elem_bytes: int = 2) -> AttentionTiles:
    """Tiles for prefill, from a sweep on an H200 (bf16, 4 x 2,048 causal tokens): 128 rows x
    64 keys; 256-wide heads need 8 warps for their fp32 accumulator and Q tile (4 warps ran at
    half the speed) and fit two pipeline stages in shared memory. fp32 pools (``elem_bytes``
    4) halve the key block, and the row block of 256-wide heads, to fit shared memory."""
    wide = max(head_dim, v_head_dim) > 128
    if elem_bytes > 2:
        return AttentionTiles(block_m=64 if wide else 128, block_n=32, num_warps=8 if wide else 4)
    if wide:
        return AttentionTiles(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return AttentionTiles(block_m=128, block_n=64, num_warps=4, num_stages=3)


def decode_tiles(
    group: int, head_dim: int, v_head_dim: int, split: bool, elem_bytes: int = 2
) -> AttentionTiles:
    """Tiles for decode: one block holds a KV head's whole query group (padded to the 16 rows of
    a tensor-core dot). A program that reads a whole sequence (``split`` False) takes 128 keys
    a step; split programs, with a few hundred keys each, 64 (an H200 sweep, bf16). fp32 pools
    halve the key block."""
    block_m = max(16, triton.next_power_of_2(group))
    block_n = (64 if split else 128) * 2 // max(elem_bytes, 2)
    return AttentionTiles(block_m=block_m, block_n=block_n, num_stages=2)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's count, so the interpreted tests split as the GPU would


def num_splits(programs: int, table_width: int, block_n: int, device: torch.device) -> int:
    """How many key splits to launch: enough programs for two waves of the device's
    multiprocessors when ``programs`` (the grid without splits) falls short, each split
    keeping at least ``MIN_SPLIT_KEYS`` of the ``table_width`` keys. Python ints only."""
    target = 2 * _multiprocessors(device)
    if programs >= target:
        return 1
    want = triton.cdiv(target, max(programs, 1))
    by_keys = max(1, table_width // max(MIN_SPLIT_KEYS, block_n))
    return max(1, min(want, by_keys, MAX_SPLITS))


def paged_attention_prefill(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    cu_seqlens: Tensor,
    prefix_lens: Tensor,
    kv_table: Tensor,
    scale: float,
    max_len: int,
    *,
    tiles: AttentionTiles | None = None,
    splits: int | None = None,
) -> Tensor:
    """Causal attention of P packed segments. ``q`` ``[Tp, Hq, D]``: segment ``p`` is rows
    ``cu_seqlens[p] : cu_seqlens[p+1]`` (int32 ``[P+1]``); its query ``i`` sits at position
    ``prefix_lens[p] + i`` (int32 ``[P]``) and attends keys ``0 .. prefix_lens[p] + i`` at
    slots ``kv_table[p, :prefix_lens[p] + len_p]`` (int32 ``[P, L]``). ``max_len`` (a Python
    int) is the longest segment's new-token count. Returns ``[Tp, Hq, Dv]`` in q's dtype.

    ``tiles`` and ``splits`` override the heuristics (tests; tuning)."""
    tokens, hq, d = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[-1]
    group = hq // hkv
    segments = cu_seqlens.shape[0] - 1
    out = q.new_empty(tokens, hq, dv)
    if tokens == 0 or segments == 0 or max_len == 0:
        return out
    tiles = tiles or prefill_tiles(d, dv, k_pool.element_size())
    m_blocks = triton.cdiv(max_len * group, tiles.block_m)
    if splits is None:
        splits = num_splits(m_blocks * hkv * segments, kv_table.shape[1], tiles.block_n, q.device)
    _attend(
        q, k_pool, v_pool, out, cu_seqlens, prefix_lens, kv_table, scale, segments, m_blocks,
        splits, tiles, decode=False,
    )  # fmt: skip
    return out


def paged_attention_decode(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    kv_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    *,
    tiles: AttentionTiles | None = None,
    splits: int | None = None,
) -> Tensor:
    """One query per request: ``q`` ``[B, Hq, D]``; request ``b`` attends the keys at
    ``kv_table[b, :seq_lens[b]]`` (int32 ``[B, L]``, padded with any valid slot; ``seq_lens``
    int32 ``[B]``, read on the device). Returns ``[B, Hq, Dv]`` in q's dtype; a row with
    ``seq_lens[b] == 0`` (a padded batch row) gets zeros.

    The grid depends only on ``B``, the heads and ``L``, so the call can be captured in a CUDA
    graph and replayed with new lengths and table contents. ``tiles`` and ``splits`` override
    the heuristics (tests; tuning)."""
    batch, hq, d = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[-1]
    group = hq // hkv
    out = q.new_empty(batch, hq, dv)
    if batch == 0:
        return out
    if splits is None:
        splits = num_splits(hkv * batch, kv_table.shape[1], MIN_SPLIT_KEYS, q.device)
    tiles = tiles or decode_tiles(group, d, dv, splits > 1, k_pool.element_size())
    m_blocks = triton.cdiv(group, tiles.block_m)
    _attend(
        q, k_pool, v_pool, out, seq_lens, seq_lens, kv_table, scale, batch, m_blocks, splits,
        tiles, decode=True,
    )  # fmt: skip
    return out


def _attend(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    out: Tensor,
    bounds: Tensor,
    prefix_lens: Tensor,
    kv_table: Tensor,
    scale: float,
    sequences: int,
    m_blocks: int,
    splits: int,
    tiles: AttentionTiles,
    decode: bool,
) -> None:
    """Launch the attention kernel (and the merge when ``splits > 1``) into ``out``. ``bounds``:
    ``cu_seqlens`` for a prefill, ``seq_lens`` for a decode."""
    tokens, hq, d = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[-1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_table.stride(-1) != 1:
        kv_table = kv_table.contiguous()
    # keys per split: whole key blocks, and no split entirely past the table
    split_len = triton.cdiv(triton.cdiv(kv_table.shape[1], splits), tiles.block_n) * tiles.block_n
    splits = max(1, triton.cdiv(kv_table.shape[1], split_len))
    if splits == 1:
        part, lse = out, out
        part_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        part = torch.empty(tokens, hq, splits, dv, dtype=torch.float32, device=q.device)
        lse = torch.empty(tokens, hq, splits, dtype=torch.float32, device=q.device)
        part_strides = part.stride()[:3]
        lse_strides = lse.stride()[:2]
    fp32 = k_pool.dtype == torch.float32
    _attention_kernel[(m_blocks, hkv, sequences * splits)](
        q, k_pool, v_pool, part, lse, bounds, prefix_lens, kv_table,
        scale * LOG2E, split_len, splits,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), *part_strides, *lse_strides, kv_table.stride(0),
        G=hq // hkv, D=d, DV=dv,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv),
        DECODE=decode, SPLIT=splits > 1,
        # fp32 pools: exact fp32 products (no TF32), as the reference computes
        PRECISION="ieee" if fp32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits[(tokens, hq)](
            part, lse, out, splits,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            DV=dv, BLOCK_DV=triton.next_power_of_2(dv),
            BLOCK_S=triton.next_power_of_2(splits),
            CHUNK_S=min(MERGE_CHUNK, triton.next_power_of_2(splits)),
            num_warps=4,
        )  # fmt: skip


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    bounds_ptr, prefix_ptr, table_ptr,
    qk_scale, split_len, num_splits,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_table,
    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DECODE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One (row block, KV head, sequence x split). Without SPLIT, writes the normalised output
    in ``out_ptr``'s dtype; with it, the fp32 partial output ``[T, Hq, splits, DV]`` and its
    base-2 log-sum-exp ``[T, Hq, splits]``."""
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    if DECODE:
        q_start = seq
        new_len = 1
        prefix = tl.load(bounds_ptr + seq) - 1  # -1 for an empty (padding) row: no keys
    else:
        q_start = tl.load(bounds_ptr + seq)
        new_len = tl.load(bounds_ptr + seq + 1) - q_start
        prefix = tl.load(prefix_ptr + seq)
    row0 = pid_m * BLOCK_M
    if row0 >= new_len * G:
        return
    rows = row0 + tl.arange(0, BLOCK_M)
    query = rows // G
    row_ok = query < new_len
    head = kvh * G + rows % G
    # the last key each row sees (rows past the segment copy its last query)
    last_key = prefix + tl.minimum(query, new_len - 1)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    token = (q_start + tl.minimum(query, new_len - 1)).to(tl.int64)

    q_ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    if BLOCK_D == D:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)

    lo = split * split_len
    hi = tl.minimum(lo + split_len, prefix + tl.minimum((row0 + BLOCK_M - 1) // G, new_len - 1) + 1)
    # keys every row of the block sees: up to its first query's position
    full = tl.minimum(hi, prefix + row0 // G + 1)
    mid = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, table_row, k_base, v_base, start, hi, last_key, qk_scale,
            stride_ks, stride_vs, offs_d, offs_dv, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
            False, PRECISION,
        )  # fmt: skip
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, table_row, k_base, v_base, start, hi, last_key, qk_scale,
            stride_ks, stride_vs, offs_d, offs_dv, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
            True, PRECISION,
        )  # fmt: skip

    # a row that saw no key (an empty split, a padding row) has l = 0: output 0, lse -inf
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = row_ok[:, None] & (offs_dv < DV)[None, :]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
    if SPLIT:
        o_ptrs += split * stride_os
        tl.store(o_ptrs, o, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        lse_ptrs = lse_ptr + token * stride_lt + head * stride_lh + split
        tl.store(lse_ptrs, lse, mask=row_ok)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, table_row, k_base, v_base, start, hi, last_key, qk_scale,
    stride_ks, stride_vs, offs_d, offs_dv,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One step of the online softmax over keys ``start .. start + BLOCK_N``. Unmasked steps
    lie wholly below ``hi`` and below every row's causal limit; masked ones check both."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        key_ok = offs_n < hi
        slots = tl.load(table_row + offs_n, mask=key_ok, other=0).to(tl.int64)
        k_mask = key_ok[None, :]
        v_mask = key_ok[:, None]
        if BLOCK_D != D:
            k_mask = k_mask & (offs_d < D)[:, None]
        if BLOCK_DV != DV:
            v_mask = v_mask & (offs_dv < DV)[None, :]
        k = tl.load(k_base + slots[None, :] * stride_ks + offs_d[:, None], mask=k_mask, other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vs + offs_dv[None, :], mask=v_mask, other=0.0)
    else:
        slots = tl.load(table_row + offs_n).to(tl.int64)
        k_ptrs = k_base + slots[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_base + slots[:, None] * stride_vs + offs_dv[None, :]
        if BLOCK_D == D:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=(offs_d < D)[:, None], other=0.0)
        if BLOCK_DV == DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=(offs_dv < DV)[None, :], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], base 2
    if MASKED:
        visible = (offs_n[None, :] <= last_key[:, None]) & (offs_n < hi)[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with no visible key yet keeps m = -inf: subtract 0 instead (exp2(-inf) = 0)
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _merge_splits(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """One (token, head): the exact softmax over all splits from each split's normalised
    output and base-2 log-sum-exp."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        lse_ptr + t * stride_lt + h * stride_lh + offs_s, mask=offs_s < num_splits,
        other=float("-inf"),
    )  # fmt: skip
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: the weights are 0
    total = tl.sum(tl.exp2(lse - top), 0)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    base = part_ptr + t * stride_pt + h * stride_ph
    for s0 in range(0, num_splits, CHUNK_S):
        offs_c = s0 + tl.arange(0, CHUNK_S)
        c_ok = offs_c < num_splits
        w = tl.exp2(
            tl.load(lse_ptr + t * stride_lt + h * stride_lh + offs_c, mask=c_ok,
                    other=float("-inf")) - top
        )  # fmt: skip
        o = tl.load(
            base + offs_c[:, None] * stride_ps + offs_dv[None, :],
            mask=c_ok[:, None] & dv_ok[None, :], other=0.0,
        )  # fmt: skip
        acc += tl.sum(o * w[:, None], 0)
    acc = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_dv, acc.to(out_ptr.dtype.element_ty),
             mask=dv_ok)  # fmt: skip
