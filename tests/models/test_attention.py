"""Pooled attention kernels and rotary embedding against direct computations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qn

from mambaradix.kernels import attention as attn_kernels
from mambaradix.kernels.attention import attention_decode, attention_prefill
from mambaradix.layers.rotary import RotaryEmbedding, rope_config


@pytest.fixture(params=["cpu_flash", "matmul"])
def softmax_path(request, monkeypatch):
    """Run a decode test through both ways of computing a softmax piece: ATen's fused CPU flash
    kernel (the default on CPU) and the plain matmul + logsumexp fallback."""
    if request.param == "matmul":
        monkeypatch.setattr(attn_kernels, "_CPU_FLASH", None)
    else:
        assert attn_kernels._CPU_FLASH is not None, "this torch has no CPU flash attention op"
    return request.param


def _naive(q, k, v, qpos, scale):
    """q [n, Hq, D], k/v [S, Hkv, D]; query i attends keys 0..qpos[i]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("nhd,shd->hns", q, k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= qpos[:, None]
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", s.softmax(-1), v)


def _one_query(q, k_pool, v_pool, slots, scale):
    """Plain softmax of one query ``q`` [Hq, D] over the keys at ``slots`` (GQA by repeat)."""
    rep = q.shape[0] // k_pool.shape[1]
    k = k_pool[slots].repeat_interleave(rep, 1)
    v = v_pool[slots].repeat_interleave(rep, 1)
    p = torch.einsum("hd,lhd->hl", q, k).mul(scale).softmax(-1)
    return torch.einsum("hl,lhd->hd", p, v)


def test_prefill_with_prefix_and_gqa(softmax_path):
    """No prefix (causal), a short one (one masked call) and one of LONG_PREFIX x the new
    tokens or more (the cascade: the prefix unmasked, the new keys causal, merged)."""
    g = torch.Generator().manual_seed(0)
    pool_k, pool_v = torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 8, generator=g)
    slots = torch.randperm(64, generator=g)[:40]
    long = attn_kernels.LONG_PREFIX * 8
    for prefix, total in ((0, 20), (7, 20), (long - 1, long + 9), (long, long + 8), (39, 40)):
        n = total - prefix
        q = torch.randn(n, 4, 8, generator=g)
        out = attention_prefill(q, pool_k, pool_v, slots[:total], prefix, 0.3)
        ref = _naive(
            q, pool_k[slots[:total]], pool_v[slots[:total]], torch.arange(prefix, total), 0.3
        )
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        # negative control: each query one key short of its own (or, with no prefix to lose
        # one from, one past it)
        shift = -1 if prefix else 1
        wrong = _naive(
            q,
            pool_k[slots[:total]],
            pool_v[slots[:total]],
            torch.arange(prefix + shift, total + shift),
            0.3,
        )
        assert (wrong - out).abs().max() > 1e-3


def test_prefill_long_prefix_with_a_value_size_of_its_own(softmax_path):
    """The cascade with values wider than keys (ATen's CPU flash kernel refuses those: the
    pieces fall back to matmul + softmax)."""
    g = torch.Generator().manual_seed(5)
    pool_k, pool_v = torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 12, generator=g)
    slots = torch.randperm(64, generator=g)[:40]
    q = torch.randn(4, 4, 8, generator=g)
    out = attention_prefill(q, pool_k, pool_v, slots, 36, 0.3)
    ref = _naive(q, pool_k[slots], pool_v[slots], torch.arange(36, 40), 0.3)
    assert out.shape == (4, 4, 12)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_prefill_long_prefix_in_bf16_stays_within_rounding():
    """The cascade path in bf16 (the engine's dtype on CPUs with bf16 matmuls) against the fp32
    plain softmax: within bf16 rounding of the output."""
    g = torch.Generator().manual_seed(4)
    pool_k, pool_v = torch.randn(600, 2, 64, generator=g), torch.randn(600, 2, 64, generator=g)
    slots = torch.randperm(600, generator=g)[:560]
    q = torch.randn(48, 8, 64, generator=g)
    prefix = 512
    assert prefix >= attn_kernels.LONG_PREFIX * q.shape[0]
    bf = torch.bfloat16
    out = attention_prefill(q.to(bf), pool_k.to(bf), pool_v.to(bf), slots, prefix, 0.125)
    ref = _naive(q, pool_k[slots], pool_v[slots], torch.arange(prefix, 560), 0.125)
    assert out.dtype == bf
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_decode_batch_with_padding(softmax_path):
    g = torch.Generator().manual_seed(1)
    pool_k, pool_v = torch.randn(64, 2, 8, generator=g), torch.randn(64, 2, 8, generator=g)
    lens = [5, 1, 12]
    seqs = [torch.randperm(64, generator=g)[:n] for n in lens]
    table = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
    q = torch.randn(3, 4, 8, generator=g)
    out = attention_decode(q, pool_k, pool_v, table, torch.tensor(lens), 0.5)
    for b, s in enumerate(seqs):
        ref = _naive(q[b : b + 1], pool_k[s], pool_v[s], torch.tensor([len(s) - 1]), 0.5)
        assert torch.allclose(out[b], ref[0], atol=1e-5)


def test_rope_config_reads_both_layouts():
    block = SimpleNamespace(rope_parameters={"rope_theta": 5e5, "partial_rotary_factor": 0.25})
    flat = SimpleNamespace(rope_theta=5e5, partial_rotary_factor=0.25)
    for cfg in (block, flat):
        p = rope_config(cfg)
        assert p["rope_theta"] == 5e5 and p["partial_rotary_factor"] == 0.25
        assert p["rope_type"] == "default"
    assert rope_config(SimpleNamespace())["partial_rotary_factor"] == 1.0


def test_partial_rotary_matches_transformers():
    cfg = SimpleNamespace(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5})
    rope = RotaryEmbedding(cfg, head_dim=16)
    assert rope.rotary_dim == 8
    pos = torch.arange(3, 13)
    q, k = torch.randn(10, 4, 16), torch.randn(10, 2, 16)
    cos, sin = rope(pos)
    ours_q, ours_k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    ref_q, ref_k = hf_qn.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    assert torch.allclose(ours_q, ref_q[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(ours_k, ref_k[0].transpose(0, 1), atol=1e-6)
    assert torch.equal(ours_q[..., 8:], q[..., 8:])  # the pass-through part is untouched


def test_decode_cascade_over_shared_prefixes_matches_per_request_softmax(softmax_path):
    """Requests whose KV rows start with the same slots read that prefix once (cascade); the
    merged result equals plain attention per request, and the groups found are the real ones."""
    from mambaradix.kernels.attention_plan import shared_prefixes

    torch.manual_seed(0)
    hq, hkv, d, pool = 4, 2, 8, 4000
    k_pool, v_pool = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
    perm = torch.randperm(pool)
    prefix_a, prefix_b = perm[:100], perm[100:140]
    own = iter(perm[140:].split(7))
    rows = [torch.cat([prefix_a, next(own)]) for _ in range(3)]  # group A: 100 shared
    rows += [torch.cat([prefix_b, next(own)]) for _ in range(2)]  # group B: 40 shared
    rows += [torch.cat([perm[:10], next(own)])]  # starts like group A, shares only 10
    rows += [next(own)]  # alone
    lens = torch.tensor([len(r) for r in rows])
    table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    q = torch.randn(len(rows), hq, d)
    groups = shared_prefixes(table, lens)
    found = sorted((m.tolist(), p) for m, p in groups)
    # rows 0-2 and 5 start alike but share only 10 slots with row 5: group A is cut to 10 < 32
    assert found == [([3, 4], 40)], found
    table2 = table[[0, 1, 2, 3, 4, 6]]
    lens2 = lens[[0, 1, 2, 3, 4, 6]]
    found2 = sorted((m.tolist(), p) for m, p in shared_prefixes(table2, lens2))
    assert found2 == [([0, 1, 2], 100), ([3, 4], 40)]
    for tab, ln, qq in ((table, lens, q), (table2, lens2, q[[0, 1, 2, 3, 4, 6]])):
        out = attention_decode(qq, k_pool, v_pool, tab, ln, 0.3)
        for b in range(tab.shape[0]):
            ref = _one_query(qq[b], k_pool, v_pool, tab[b, : ln[b]], 0.3)
            torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=0)


def test_decode_cascade_batches_groups_of_equal_prefix_length(softmax_path):
    """Groups with the same shared length run as one batched piece (the smaller group padded
    with copies of a member); each request still gets its own exact softmax."""
    from mambaradix.kernels.attention_plan import decode_plan, shared_prefixes

    torch.manual_seed(1)
    hq, hkv, d, pool = 8, 2, 16, 6000
    k_pool, v_pool = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
    perm = torch.randperm(pool)
    own = iter(perm[300:].split(11))
    prefixes = [perm[:64], perm[64:128], perm[128:192], perm[192:232]]
    sizes = [5, 2, 3, 4]  # three groups share 64 slots, one 40
    rows = [torch.cat([p, next(own)[: 3 + i]]) for p, n in zip(prefixes, sizes) for i in range(n)]
    order = torch.randperm(len(rows)).tolist()  # members of a group are not adjacent
    rows = [rows[i] for i in order]
    lens = torch.tensor([len(r) for r in rows])
    table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    groups = shared_prefixes(table, lens)
    assert sorted(len(m) for m, _ in groups) == [2, 3, 4, 5]
    assert sorted(p for _, p in groups) == [40, 64, 64, 64]
    q = torch.randn(len(rows), hq, d)
    plan = decode_plan(table, lens, hkv, groups)
    assert sorted((p.plen, p.n, p.width) for p in plan.pieces) == [(40, 1, 4), (64, 3, 5)]
    out = attention_decode(q, k_pool, v_pool, table, lens, 0.25, plan)
    for b in range(len(rows)):
        ref = _one_query(q[b], k_pool, v_pool, table[b, : lens[b]], 0.25)
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=0)


def test_decode_plan_is_reused_while_its_pieces_hold(softmax_path):
    """The next decode step (one more slot per row) reuses the previous plan's pieces; a row
    whose prefix slots changed, or another batch size, makes a new plan. Negative control: the
    stale plan applied to the changed table gives wrong outputs, so the check matters."""
    from mambaradix.kernels.attention_plan import decode_plan

    torch.manual_seed(4)
    hq, hkv, d, pool = 4, 2, 8, 3000
    k_pool, v_pool = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
    perm = torch.randperm(pool)
    prefix, own = perm[:48], iter(perm[100:].split(20))
    rows = [torch.cat([prefix, next(own)[: 4 + i]]) for i in range(5)] + [next(own)[:9]]

    def batch(rows):
        lens = torch.tensor([len(r) for r in rows])
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lens

    def check(q, table, lens, plan):
        out = attention_decode(q, k_pool, v_pool, table, lens, 0.3, plan)
        refs = [_one_query(q[b], k_pool, v_pool, table[b, : lens[b]], 0.3) for b in range(len(q))]
        return all(torch.allclose(o, ref, atol=1e-5) for o, ref in zip(out, refs))

    table, lens = batch(rows)
    first = decode_plan(table, lens, hkv)
    assert [p.plen for p in first.pieces] == [48]
    rows = [torch.cat([r, next(own)[:1]]) for r in rows]  # the next step: one slot more each
    table, lens = batch(rows)
    q = torch.randn(len(rows), hq, d)
    step = decode_plan(table, lens, hkv, previous=first)
    assert step.pieces is first.pieces and torch.equal(step.seq_lens, lens)
    assert check(q, table, lens, step)
    changed = rows[:2] + [torch.cat([perm[60:100], next(own)])] + rows[3:]  # row 2 left
    table, lens = batch(changed)
    fresh = decode_plan(table, lens, hkv, previous=step)
    assert fresh.pieces is not step.pieces and check(q, table, lens, fresh)
    stale = decode_plan(table, lens, hkv)
    stale.pieces, stale.begin, stale.shared_row = step.pieces, step.begin, step.shared_row
    stale.shared_members = step.shared_members
    assert not check(q, table, lens, stale)
    table, lens = batch(rows[:4])
    assert decode_plan(table, lens, hkv, previous=step).pieces is not step.pieces


def test_prefill_cascade_over_a_shared_prefix_matches_per_request(softmax_path):
    """Members of a group read the shared prefix once; some have cached more than the shared
    part (extra visible keys before their queries), extend lengths differ, and members of the
    same shape attend their own keys in one batched call. Each output
    equals plain causal attention over the member's own keys."""
    from mambaradix.kernels.attention import attention_prefill_shared

    torch.manual_seed(3)
    hq, hkv, d, pool = 8, 2, 16, 3000
    k_pool, v_pool = torch.randn(pool, hkv, d), torch.randn(pool, hkv, d)
    perm = torch.randperm(pool)
    shared = perm[:70]
    rest = iter(perm[70:].split(40))
    # (extra cached keys beyond the shared prefix, new tokens); equal shapes share one call
    shapes = [(0, 17), (0, 1 + 4), (23, 9), (0, 17), (23, 9), (0, 40)]
    qs, slots, plens = [], [], []
    for extra, n in shapes:
        own = next(rest)[: extra + n] if extra + n <= 40 else None
        slots.append(torch.cat([shared, own]))
        plens.append(70 + extra)
        qs.append(torch.randn(n, hq, d))
    outs = attention_prefill_shared(qs, k_pool, v_pool, slots, plens, 70, 0.3)
    for q, sl, plen, out in zip(qs, slots, plens, outs):
        ref = _naive(q, k_pool[sl], v_pool[sl], torch.arange(plen, len(sl)), 0.3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # negative control: dropping the shared piece (attending own keys only) is far off
    from mambaradix.kernels.attention import _attend_own

    alone, _ = _attend_own(qs[0][None], k_pool, v_pool, slots[0][None, 70:], 0, 0.3)
    assert (alone[0] - outs[0]).abs().max() > 1e-2


def test_scheduler_decode_table_gives_the_same_slots_as_the_requests():
    """A batch may carry its decodes' slot rows as one table (the scheduler's single gather,
    with stale slots past each request's length); the context and the layout read the same
    new-token slots and the same per-request keys from it as from the requests themselves."""
    from mambaradix.core import ForwardReq
    from mambaradix.layout import ForwardLayout

    torch.manual_seed(4)
    lens = [5, 9, 3]
    table = torch.randint(0, 500, (3, 12))  # entries past each length are stale slots
    reqs = [ForwardReq(n - 1, [7], table[b, :n], 10 + b) for b, n in enumerate(lens)]
    reqs.append(ForwardReq(2, [1, 2, 3], torch.tensor([600, 601, 602, 603, 604]), 20))
    plain = ForwardLayout.build(reqs)
    given = ForwardLayout.build(reqs, decode_table=table)
    assert torch.equal(given.out_kv_slots, plain.out_kv_slots)
    assert given.out_kv_slots[:3].tolist() == [table[b, n - 1].item() for b, n in enumerate(lens)]
    t_plain, l_plain = plain.decode.kv_table, plain.decode.seq_lens
    t_given, l_given = given.decode.kv_table, given.decode.seq_lens
    assert t_given is table and torch.equal(l_given, l_plain)
    for b, n in enumerate(lens):
        assert torch.equal(t_given[b, :n], t_plain[b, :n])
    # control: a table whose rows do not match the requests is visible in the slots read
    shifted = ForwardLayout.build(reqs, decode_table=table.roll(1, dims=0))
    assert not torch.equal(shifted.out_kv_slots, plain.out_kv_slots)
