"""Attention over the pooled KV (torch reference kernels).

K/V live in pool tensors ``[pool_size, Hkv, D]`` addressed by slot; the kernels gather what they
need. Queries use grouped heads: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaradix.kernels.attention_plan import DecodePlan, decode_plan, pool_rows

LONG_PREFIX = 2  # attention_prefill: a prefix this many times the new tokens goes as a cascade


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
    ``kv_slots`` (already written). Returns ``[n, Hq, Dv]``.

    A cached prefix of at least ``LONG_PREFIX`` x n keys is attended as a cascade
    (``_attend_own``): the prefix in one unmasked call with the queries grouped by KV head (no
    mask to read, K/V not repeated per query head), the new keys causally, the two merged by
    their log-sum-exp. On 2 cores that took a 512-token chunk
    over 16k keys from 632 to 417 ms (8 / 2 heads of 256) and 336 to 189 ms (12 / 4 of 64);
    over 1k keys the one masked call is faster (30 against 39 ms at 8 / 2 x 256).
    """
    n = q.shape[0]
    if prefix_len >= LONG_PREFIX * n:
        out, _ = _attend_own(q[None], k_pool, v_pool, kv_slots[None], prefix_len, scale)
        return out[0].to(q.dtype)
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


def attention_prefill_shared(
    qs: list[torch.Tensor],
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    kv_slots: list[torch.Tensor],
    prefix_lens: list[int],
    shared_len: int,
    scale: float,
) -> list[torch.Tensor]:
    """``attention_prefill`` for a group of requests whose keys start with the same
    ``shared_len`` slots (a prefix they share through the radix cache, ``shared_len <=`` every
    member's ``prefix_len``). Request i has queries ``qs[i]`` ``[n_i, Hq, D]`` at positions
    ``prefix_lens[i] ..`` and keys ``kv_slots[i]`` (``prefix_lens[i] + n_i`` slots).

    Cascade: the shared prefix is read once and every member's queries attend it in one call
    (no mask: all of it precedes every query); each member then attends its own remaining keys
    (causal), and the two softmax pieces merge by their log-sum-exp. Returns the outputs in
    the order of ``qs``.
    """
    hkv, d = k_pool.shape[1], k_pool.shape[2]
    hq = qs[0].shape[1]
    r = hq // hkv
    k, v = _gather_kv(k_pool, v_pool, kv_slots[0][None, :shared_len])
    # every member's queries, grouped by KV head: [1, Hkv, sum(n_i) * R, D]
    stacked = torch.cat([q.to(k.dtype).view(-1, hkv, r, d).transpose(0, 1) for q in qs], dim=1)
    shared_out, shared_lse = _attend(stacked.reshape(1, hkv, -1, d), k, v, None, scale)
    first = [0]
    for q in qs:
        first.append(first[-1] + q.shape[0])

    def member(t: torch.Tensor, i: int) -> torch.Tensor:
        # [1, Hkv, rows, *] -> member i's [n_i, Hq, *]
        n = qs[i].shape[0]
        t = t[0, :, first[i] * r : first[i + 1] * r].reshape(hkv, n, r, -1)
        return t.transpose(0, 1).reshape(n, hq, -1)

    # own keys: members with the same (new tokens, earlier own keys) share one call
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, (q, plen) in enumerate(zip(qs, prefix_lens)):
        buckets.setdefault((q.shape[0], plen - shared_len), []).append(i)
    outs: list[torch.Tensor | None] = [None] * len(qs)
    for (n, seen), members in buckets.items():
        own = torch.stack([kv_slots[i][shared_len : shared_len + seen + n] for i in members])
        q_b = torch.stack([qs[i] for i in members])  # [M, n, Hq, D]
        oo, ol = _attend_own(q_b, k_pool, v_pool, own, seen, scale)  # [M, n, Hq, *]
        so = torch.stack([member(shared_out, i) for i in members])
        sl = torch.stack([member(shared_lse.unsqueeze(-1), i)[..., 0] for i in members])
        merged, _ = _merge(so, sl, oo, ol)
        for row, i in enumerate(members):
            outs[i] = merged[row].to(qs[i].dtype)
    return outs


def _attend_own(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    seen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q`` ``[M, n, Hq, D]`` of M requests over their keys at ``slots`` ``[M, L]``:
    the first ``seen`` precede every query, the last ``n`` are the queries' own tokens
    (causal). Returns ``(out [M, n, Hq, Dv], lse [M, n, Hq])`` in fp32.

    ``seen`` of at least ``LONG_PREFIX`` x n keys go as ``attention_prefill``'s cascade: those
    keys unmasked with the queries grouped by KV head, the last n causal, merged."""
    m, n, hq, d = q.shape
    hkv = k_pool.shape[1]
    r = hq // hkv
    if seen and seen >= LONG_PREFIX * n:
        k, v = _gather_kv(k_pool, v_pool, slots[:, :seen])  # [M, Hkv, seen, D]
        qg = q.to(k.dtype).view(m, n, hkv, r, d).transpose(1, 2).reshape(m, hkv, n * r, d)
        o, lse = _attend(qg, k, v, None, scale)  # [M, Hkv, n * r, Dv], [M, Hkv, n * r]
        o = o.view(m, hkv, n, r, -1).transpose(1, 2).reshape(m, n, hq, -1)
        lse = lse.view(m, hkv, n, r).transpose(1, 2).reshape(m, n, hq)
        return _merge(o, lse, *_attend_own(q, k_pool, v_pool, slots[:, seen:], 0, scale))
    k, v = _gather_kv(k_pool, v_pool, slots)  # [M, Hkv, L, D]
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    qh = q.to(k.dtype).transpose(1, 2)  # [M, Hq, n, D]
    visible = None
    if seen:  # with no earlier keys the mask is plain causal
        visible = torch.arange(slots.shape[1])[None, :] <= (seen + torch.arange(n))[:, None]
    out, lse = _attend(qh, k, v, visible, scale, causal=seen == 0)
    return out.transpose(1, 2), lse.transpose(1, 2)


def _merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax over the union of two key sets from each one's (output, log-sum-exp)."""
    top = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - top)[..., None] + o2 * torch.exp(l2 - top)[..., None], top


def attend_shared(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared pieces of ``plan``: each group's queries (``q`` ``[B, Hq, D]``) against its
    one prefix, in one call per piece. Returns the stacked rows ``(out [R, Hq, Dv], lse [R, Hq])``
    in fp32 (request ``b``'s row is ``plan.shared_row[b]``), or None without pieces."""
    if not plan.pieces:
        return None
    B, Hq, D = q.shape
    g = k_pool.shape[1]
    r = Hq // g
    qg = q.to(k_pool.dtype).view(B, g, r, D)
    outs, lses = [], []
    for p in plan.pieces:
        k, v = _kv_at(k_pool, v_pool, p.kv_rows, p.n, p.plen)
        # [n*width, g, r, D] -> [n, g, width*r, D]: a group's queries against its one prefix
        qb = qg.index_select(0, p.queries).view(p.n, p.width, g, r, D)
        qb = qb.transpose(1, 2).reshape(p.n, g, p.width * r, D)
        o, lse = _attend(qb, k, v, None, scale)
        outs.append(o.view(p.n, g, p.width, r, -1).transpose(1, 2).reshape(p.n * p.width, Hq, -1))
        lses.append(lse.view(p.n, g, p.width, r).transpose(1, 2).reshape(p.n * p.width, Hq))
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def attention_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query per request for B requests: ``q`` ``[B, Hq, D]``; request ``b`` attends the
    keys at ``slot_table[b, :seq_lens[b]]`` (``slot_table`` ``[B, L]``, padded with any valid
    slot). Returns ``[B, Hq, Dv]``.

    Cascade: requests whose rows start with the same KV slots (a prefix shared through the
    radix cache) read that prefix once per group; each request then reads only its own part,
    and the two softmax pieces are merged exactly by their log-sum-exp. ``plan``
    (``decode_plan``, once per forward) may be passed in; else it is computed.
    """
    B, Hq, D = q.shape
    g = k_pool.shape[1]
    if plan is None:
        plan = decode_plan(slot_table, seq_lens, g)
    span, rows, visible = plan.own_keys()
    k, v = _kv_at(k_pool, v_pool, rows, B, span)
    o, lse = _attend(q.to(k_pool.dtype).view(B, g, Hq // g, D), k, v, visible, scale)
    o, lse = o.reshape(B, Hq, -1), lse.reshape(B, Hq)
    shared = attend_shared(q, k_pool, v_pool, plan, scale)
    if shared is not None:
        m = plan.shared_members
        rows_of = plan.shared_row.index_select(0, m)
        merged, _ = _merge(
            o.index_select(0, m),
            lse.index_select(0, m),
            shared[0].index_select(0, rows_of),
            shared[1].index_select(0, rows_of),
        )
        o.index_copy_(0, m, merged)
    return o.to(q.dtype)


def _gather_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at ``slots`` [n, L], gathered straight into [n, Hkv, L, D] (contiguous for the
    matmuls)."""
    n, length = slots.shape
    return _kv_at(k_pool, v_pool, pool_rows(slots, k_pool.shape[1]), n, length)


def _kv_at(
    k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, n: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at pool ``rows`` (``_pool_rows`` of ``[n, length]`` slots) as ``[n, Hkv, length,
    D]``."""
    g = k_pool.shape[1]
    k = k_pool.reshape(-1, k_pool.shape[-1]).index_select(0, rows).view(n, g, length, -1)
    v = v_pool.reshape(-1, v_pool.shape[-1]).index_select(0, rows).view(n, g, length, -1)
    return k, v


def _attend(
    qg: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``qg`` [n, G, M, D] over ``k``/``v`` [n, G, L, D]: ``(out [n, G, M,
    Dv] fp32, log-sum-exp of the scaled scores [n, G, M] fp32)``, the two things an exact merge
    of pieces needs. ``visible``: a bool mask broadcastable to the scores [n, G, M, L] (every
    query keeps at least one key), or ``causal`` (query i sees keys 0..i).

    On CPU this is ATen's fused flash kernel (blocked, scores never materialised; it returns
    the log-sum-exp); elsewhere, with a value size other than the key size (which that kernel
    refuses), or if that op is missing, plain matmul + softmax.
    """
    if qg.device.type == "cpu" and _CPU_FLASH is not None and k.shape[-1] == v.shape[-1]:
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=qg.dtype, device=qg.device)
            mask = mask.masked_fill_(~visible, float("-inf"))
        out, lse = _CPU_FLASH(qg, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
        return out.float(), lse.float()
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if causal:
        m, length = scores.shape[-2:]
        visible = torch.ones(m, length, dtype=torch.bool, device=qg.device).tril()
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs.to(v.dtype), v).float(), lse


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
