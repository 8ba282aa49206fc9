"""Attention over the pooled KV (torch reference kernels).

K/V live in pool tensors ``[pool_size, Hkv, D]`` addressed by slot; the kernels gather what they
need. Queries use grouped heads: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaradix.kernels.registry import register_kernel


@register_kernel("attention_prefill")
def attention_prefill(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's ``n`` new queries (``q`` ``[n, Hq, D]``, absolute
    positions ``prefix_len .. prefix_len+n-1``) over its ``prefix_len + n`` keys at
    ``kv_slots`` (already written). Returns ``[n, Hq, Dv]``."""
    n = q.shape[0]
    k = k_pool.index_select(0, kv_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
    v = v_pool.index_select(0, kv_slots).transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, Hq, n, D]
    gqa = qh.shape[1] != k.shape[1]
    if prefix_len == 0:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        s = k.shape[2]
        qpos = torch.arange(prefix_len, prefix_len + n, device=q.device)
        mask = torch.arange(s, device=q.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1).to(q.dtype)


@register_kernel("attention_decode")
def attention_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per request for B requests: ``q`` ``[B, Hq, D]``; request ``b`` attends the
    keys at ``slot_table[b, :seq_lens[b]]`` (``slot_table`` ``[B, L]``, padded with any valid
    slot). Returns ``[B, Hq, Dv]``."""
    B, Hq, D = q.shape
    L = slot_table.shape[1]
    flat = slot_table.reshape(-1)
    k = k_pool.index_select(0, flat).view(B, L, -1, D)  # [B, L, Hkv, D]
    v = v_pool.index_select(0, flat).view(B, L, k.shape[2], -1)
    hkv = k.shape[2]
    rep = Hq // hkv
    qg = q.to(k.dtype).view(B, hkv, rep, D)
    scores = torch.einsum("bgrd,blgd->bgrl", qg, k) * scale
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.einsum("bgrl,blgd->bgrd", probs, v)
    return out.reshape(B, Hq, -1).to(q.dtype)
