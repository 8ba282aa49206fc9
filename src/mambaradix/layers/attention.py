"""Attention over the pooled KV: store the new tokens' K/V, then the backend's paged attention
for the prefill segments and for the decodes of the forward's layout."""

from __future__ import annotations

import torch

from mambaradix.kernels.backend import KernelBackend
from mambaradix.layout import ForwardContext


def pooled_attention(
    ops: KernelBackend,
    ctx: ForwardContext,
    attn_layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write the new tokens' K/V into attention layer ``attn_layer`` of the pool and attend.

    ``q`` ``[T, Hq, Dh]``, ``k``/``v`` ``[T, Hkv, Dh]`` for all packed new tokens (RoPE applied).
    Returns ``[T, Hq, Dv]``.
    """
    layout = ctx.layout
    k_pool, v_pool = ctx.kv_pool.k[attn_layer], ctx.kv_pool.v[attn_layer]
    ops.store_kv(k, v, k_pool, v_pool, layout)
    dec, pre = layout.decode, layout.prefill
    out = q.new_empty(q.shape[0], q.shape[1], v_pool.shape[-1])
    if pre is not None:
        o = ops.paged_attention_prefill(pre.rows.take(q), k_pool, v_pool, layout, scale)
        out = pre.rows.put(out, o)
    if dec is not None:
        o = ops.paged_attention_decode(dec.rows.take(q), k_pool, v_pool, layout, scale)
        out = dec.rows.put(out, o)
    return out
