"""The native ``cpu`` kernel backend against the torch reference kernels."""

from __future__ import annotations

import shutil

import pytest
import torch

from mambaradix.kernels import attention_plan, cpu, native
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)


def test_native_kernels_build_here():
    assert native.available(), "the native kernels failed to build (see the log)"


def _pools(slots_total, hk, hv, dk, dv, width, seed):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    conv = torch.randn(slots_total, conv_dim, width - 1, generator=g)
    ssm = torch.randn(slots_total, hv, dk, dv, generator=g) * 0.3
    weight = torch.randn(conv_dim, width, generator=g) * 0.5
    return g, conv, ssm, weight


@pytest.mark.parametrize(
    "hk,hv,dk,dv,width,activation,bias",
    [
        (2, 4, 8, 16, 4, "silu", False),
        (2, 2, 16, 8, 4, None, True),
        (1, 3, 8, 8, 2, "silu", True),
        (1, 2, 128, 128, 4, "silu", False),  # Qwen3.5's heads: the C code's unrolled case
    ],
)
def test_gated_delta_decode_matches_reference_in_place(hk, hv, dk, dv, width, activation, bias):
    """Same outputs, same new conv and delta states in the requests' slots, every other slot
    untouched; x given as a strided view (the qwen3_5 layout splits it out of a wider
    projection)."""
    B, S = 5, 12
    g, conv, ssm, weight = _pools(S, hk, hv, dk, dv, width, seed=hk + hv + width)
    conv_dim = conv.shape[1]
    x = torch.randn(B, conv_dim + 7, generator=g)[:, 3 : 3 + conv_dim]
    # the gate projections as strided columns of one [B, 2 Hv] tensor, as the layer has them;
    # one a + dt_bias above softplus's linear threshold (20)
    ab = torch.randn(B, 2 * hv, generator=g) * 3
    ab[0, 0] = 25.0
    a_log, dt_bias = torch.randn(hv, generator=g) * 0.5, torch.rand(hv, generator=g)
    gates = (ab[:, :hv], ab[:, hv:], a_log, dt_bias)
    b = torch.randn(conv_dim, generator=g) if bias else None
    slots = torch.tensor([7, 0, 11, 3, 5])
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref = TorchBackend.gated_delta_step(
        x, ref_conv, ref_ssm, slots, weight, b, *gates, hk, activation
    )
    out = CpuBackend.gated_delta_step(x, conv, ssm, slots, weight, b, *gates, hk, activation)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv, ref_conv, atol=0, rtol=0)
    torch.testing.assert_close(ssm, ref_ssm, atol=1e-5, rtol=1e-5)
    # the slots really moved (a kernel that wrote nothing would match an untouched reference
    # only if the reference wrote nothing either)
    _, conv0, ssm0, _ = _pools(S, hk, hv, dk, dv, width, seed=hk + hv + width)
    assert not torch.allclose(ssm[slots], ssm0[slots])
    other = torch.tensor([i for i in range(S) if i not in slots.tolist()])
    assert torch.equal(ssm[other], ssm0[other]) and torch.equal(conv[other], conv0[other])


def test_gated_delta_decode_falls_back_for_other_dtypes():
    """bf16 pools are outside the C kernel: the cpu backend hands them to the reference."""
    hk, hv, dk, dv, width, B, S = 1, 2, 8, 8, 4, 3, 6
    g, conv, ssm, weight = _pools(S, hk, hv, dk, dv, width, seed=9)
    x = torch.randn(B, conv.shape[1], generator=g).bfloat16()
    gates = (torch.randn(B, hv, generator=g), torch.randn(B, hv, generator=g))
    gates += (torch.zeros(hv), torch.ones(hv))
    slots = torch.tensor([4, 1, 2])
    args = (slots, weight.bfloat16(), None, *gates, hk, "silu")
    ref = TorchBackend.gated_delta_step(x, conv.clone(), ssm.clone(), *args)
    out = CpuBackend.gated_delta_step(x, conv, ssm, *args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


def test_gated_delta_decode_silu_over_a_wide_range():
    """Conv outputs from -300 to 300 (exp overflows at one end, underflows at the other):
    the C silu and the state update still match the reference, and stay finite."""
    hk, hv, dk, dv, width, B = 1, 2, 8, 8, 4, 6
    g, conv, ssm, weight = _pools(8, hk, hv, dk, dv, width, seed=21)
    conv.zero_()  # the conv output is then weight[:, -1] * x: set it through x
    weight[:, -1] = 1.0
    x = torch.linspace(-300, 300, B * conv.shape[1]).reshape(B, -1)
    x = x[:, torch.randperm(x.shape[1], generator=g)]
    gates = (torch.zeros(B, hv), torch.zeros(B, hv), torch.zeros(hv), torch.ones(hv))
    slots = torch.arange(B)
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    ref = TorchBackend.gated_delta_step(
        x, ref_conv, ref_ssm, slots, weight, None, *gates, hk, "silu"
    )
    out = CpuBackend.gated_delta_step(x, conv, ssm, slots, weight, None, *gates, hk)
    assert torch.isfinite(out).all() and torch.isfinite(ssm).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ssm, ref_ssm, atol=1e-4, rtol=1e-5)


def test_gated_delta_decode_rejects_mismatched_shapes():
    hk, hv, dk, dv, width = 2, 4, 8, 8, 4
    g, conv, ssm, weight = _pools(4, hk, hv, dk, dv, width, seed=1)
    x = torch.randn(2, conv.shape[1] + 8, generator=g)
    with pytest.raises(ValueError, match="key heads"):
        CpuBackend.gated_delta_step(
            x, conv, ssm, torch.tensor([0, 1]), weight, None, torch.zeros(2, hv),
            torch.zeros(2, hv), torch.zeros(hv), torch.zeros(hv), hk,
        )  # fmt: skip


@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_matches_reference_on_dense_and_strided_rows(zero_centered):
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(32, generator=g) * 0.2
    dense = torch.randn(7, 5, 32, generator=g) * 3
    # the query half of a [T, heads, 2 * d] projection: rows of 32 with a row stride of 64
    strided = torch.randn(9, 4, 64, generator=g)[..., :32]
    for x in (dense, strided, dense[0, 0]):
        ref = TorchBackend.rms_norm(x, weight, 1e-6, zero_centered)
        out = CpuBackend.rms_norm(x, weight, 1e-6, zero_centered)
        assert out.shape == x.shape
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # negative control: a different eps moves the result
    far = CpuBackend.rms_norm(dense * 1e-3, weight, 1e-2, zero_centered)
    near = TorchBackend.rms_norm(dense * 1e-3, weight, 1e-6, zero_centered)
    assert (far - near).abs().max() > 1e-2


def test_rms_norm_falls_back_for_bf16_and_unmergeable_views():
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(16, generator=g)
    x = torch.randn(6, 16, generator=g)
    for inp, w in ((x.bfloat16(), weight.bfloat16()), (x.t().contiguous().t(), weight)):
        ref = TorchBackend.rms_norm(inp, w, 1e-6, False)
        torch.testing.assert_close(CpuBackend.rms_norm(inp, w, 1e-6, False), ref)


def test_rms_norm_gated_matches_reference_for_dense_and_strided_gates():
    """The GDN output norm: x dense ``[T, H, D]``, the gate either dense or a strided slice of a
    wider projection (the qwen3_next layout); other dtypes fall back to the reference."""
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(32, generator=g) * 0.5 + 1
    x = torch.randn(9, 4, 32, generator=g) * 2
    dense = torch.randn(9, 4, 32, generator=g) * 2
    strided = torch.randn(9, 4, 80, generator=g)[..., 16:48]
    assert not strided.is_contiguous()
    for gate in (dense, strided):
        ref = TorchBackend.rms_norm_gated(x, gate, weight, 1e-6)
        out = CpuBackend.rms_norm_gated(x, gate, weight, 1e-6)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the gate is applied: a zero gate gives zeros (silu(0) = 0)
    zero = CpuBackend.rms_norm_gated(x, torch.zeros_like(x), weight, 1e-6)
    assert torch.equal(zero, torch.zeros_like(x))
    half = CpuBackend.rms_norm_gated(x.bfloat16(), dense.bfloat16(), weight, 1e-6)
    ref = TorchBackend.rms_norm_gated(x.bfloat16(), dense.bfloat16(), weight, 1e-6)
    assert half.dtype == torch.bfloat16 and torch.equal(half, ref)


def _decode_case(seed, hq, hkv, d, dv, sizes, own_max, size=400):
    """A slot table like a decode step's: groups of requests whose rows start with the same
    shared prefix (``sizes`` = (members, prefix length) per group, a prefix length of 0 for
    requests without one), then own keys of different lengths; rows padded with slot 0."""
    g = torch.Generator().manual_seed(seed)
    k_pool, v_pool = torch.randn(size, hkv, d, generator=g), torch.randn(size, hkv, dv, generator=g)
    free = iter(torch.randperm(size, generator=g).tolist())
    rows = []
    for members, plen in sizes:
        prefix = torch.tensor([next(free) for _ in range(plen)], dtype=torch.long)
        for _ in range(members):
            n = int(torch.randint(1, own_max + 1, (), generator=g))
            rows.append(torch.cat([prefix, torch.tensor([next(free) for _ in range(n)])]))
    lens = torch.tensor([len(r) for r in rows])
    table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    q = torch.randn(len(rows), hq, d, generator=g)
    return q, k_pool, v_pool, table, lens


@pytest.mark.parametrize(
    "hq,hkv,d,dv,sizes,own_max",
    [
        (8, 2, 16, 16, [(5, 64), (3, 64), (4, 40), (1, 0), (2, 0)], 9),  # two pieces + loners
        (4, 4, 8, 8, [(6, 48)], 30),  # every request in one group, no grouped heads
        (6, 2, 32, 32, [(3, 0)], 70),  # no sharing at all: own keys only
    ],
)
def test_attention_decode_matches_reference(hq, hkv, d, dv, sizes, own_max):
    """Own keys read in place and merged in C with the shared pieces == the torch cascade and
    a plain softmax over each request's keys."""
    q, k_pool, v_pool, table, lens = _decode_case(len(sizes) + d, hq, hkv, d, dv, sizes, own_max)
    ref = TorchBackend.attention_decode(q, k_pool, v_pool, table, lens, 0.3)
    out = CpuBackend.attention_decode(q, k_pool, v_pool, table, lens, 0.3)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    r = hq // hkv
    for b in range(len(lens)):  # independent of the cascade: one softmax per request
        keys = table[b, : lens[b]]
        k = k_pool[keys].repeat_interleave(r, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v_pool[keys].repeat_interleave(r, dim=1).transpose(0, 1)
        p = torch.softmax((q[b][:, None, :] * k).sum(-1) * 0.3, dim=-1)
        torch.testing.assert_close(out[b], (p[..., None] * v).sum(1), atol=2e-6, rtol=1e-5)


def _verify_case(seed, hq, hkv, d, widths, dtype, own=(3, 30)):
    """A verify step's decode rows: request i has ``widths[i]`` rows (its last token and
    drafts), each attending the request's KV slots up to its own position (``own``: the range
    of its own keys before them); requests 0 and 1 share a 40-slot prefix (one cascade piece
    holding all their rows)."""
    g = torch.Generator().manual_seed(seed)
    size = max(600, 40 + len(widths) * (own[1] + max(widths)))
    k_pool = torch.randn(size, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(size, hkv, d, generator=g).to(dtype)
    free = iter(torch.randperm(size, generator=g).tolist())
    prefix = [next(free) for _ in range(40)]
    rows, lens = [], []
    for i, w in enumerate(widths):
        mine = [next(free) for _ in range(int(torch.randint(*own, (), generator=g)) + w)]
        slots = (prefix if i < 2 else []) + mine
        for j in range(w):
            rows.append(torch.tensor(slots))
            lens.append(len(slots) - w + 1 + j)
    table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    lens = torch.tensor(lens)
    cu = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()])
    shared = [(torch.arange(int(cu[2])), 40)]
    plan = attention_plan.decode_plan(table, lens, hkv, groups=shared)
    q = torch.randn(len(rows), hq, d, generator=g).to(dtype)
    return q, k_pool, v_pool, table, lens, cu, plan


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hq,hkv,d,own",
    [(8, 2, 16, (3, 30)), (4, 1, 256, (3, 30)), (8, 2, 32, (500, 800)), (8, 2, 256, (300, 600))],
)
def test_attention_decode_reads_a_requests_verify_rows_together(hq, hkv, d, own, dtype):
    """A verify step's rows of one request read its keys once (``row_groups``, up to 16 rows a
    task: the 20-row request is taken in two), also over several splits of 256 keys (rows that
    end in different splits): every row's output is bit for bit what it gets alone, and
    matches the reference."""
    q, k_pool, v_pool, table, lens, cu, plan = _verify_case(
        d, hq, hkv, d, [4, 1, 3, 20], dtype, own
    )
    groups = cpu.verify_row_groups(cu, table, lens, plan.begin)
    assert groups is not None and torch.equal(groups, cu)
    together = cpu.attention_decode(q, k_pool, v_pool, table, lens, 0.2, plan, groups)
    alone = cpu.attention_decode(q, k_pool, v_pool, table, lens, 0.2, plan)
    assert torch.equal(together, alone)
    ref = TorchBackend.attention_decode(q, k_pool, v_pool, table, lens, 0.2, plan)
    # (fp32: scores of 256-wide heads over hundreds of keys, summed in another order)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(together.float(), ref.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decode_long_rows_in_splits(dtype):
    """Own keys past one split (256 keys: 1, 2, 3 and 4 splits, ends inside and on a split's
    edge), with and without a shared piece: == the reference; and each row's output is bit for
    bit the same alone or in the batch and on 1, 2 or 3 threads, where the tasks take whole slot
    rows (every KV head) or a KV head each. Control: moving one key of the last split moves
    the output of the row that owns it only."""
    q, k_pool, v_pool, table, lens = _decode_case(7, 8, 2, 32, 32, [(2, 300), (1, 0)], 900, 3000)
    own = torch.tensor([[255, 256, 257, 1024]]).T  # rows with no shared prefix, set lengths
    loners = torch.randint(0, 3000, (4, 1024), generator=torch.Generator().manual_seed(1))
    table = torch.nn.utils.rnn.pad_sequence([*table, *loners], batch_first=True)
    lens = torch.cat([lens, own[:, 0]])
    g = torch.Generator().manual_seed(2)
    q = torch.cat([q, torch.randn(4, 8, 32, generator=g)])
    q, k_pool, v_pool = q.to(dtype), k_pool.to(dtype), v_pool.to(dtype)
    ref = TorchBackend.attention_decode(q, k_pool, v_pool, table, lens, 0.3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = CpuBackend.attention_decode(q, k_pool, v_pool, table, lens, 0.3)
        tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.float(), ref.float(), **tol)
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for b in range(3, len(lens)):  # the rows without a shared piece, one at a time
                alone = CpuBackend.attention_decode(q[b : b + 1], k_pool, v_pool, table[b : b + 1],
                                                    lens[b : b + 1], 0.3)  # fmt: skip
                assert torch.equal(alone[0], out[b]), (threads, b)
            again = CpuBackend.attention_decode(q, k_pool, v_pool, table, lens, 0.3)
            assert torch.equal(again, out)
        v2 = v_pool.clone()
        v2[table[-1, 1000]] += 1.0  # the 1,024-key row's fourth split
        moved = CpuBackend.attention_decode(q, k_pool, v2, table, lens, 0.3)
    finally:
        torch.set_num_threads(before)
    changed = {b for b in range(len(lens)) if not torch.equal(moved[b], out[b])}
    owners = {b for b in range(len(lens)) if table[b, : lens[b]].eq(table[-1, 1000]).any()}
    assert changed == owners and len(lens) - 1 in changed


def test_verify_row_groups_refuses_rows_that_do_not_share_their_keys():
    """Negative control: a request's row whose keys differ from its last row's (within its own
    length) gets no groups, and forcing them would change its output (a group reads the
    longest row's slots), so the check is what keeps the result right."""
    q, k_pool, v_pool, table, lens, cu, plan = _verify_case(3, 8, 2, 16, [4, 3], torch.float32)
    bad = table.clone()
    bad[1, int(lens[1]) - 2] = 599  # row 1 (request 0's second) reads another key there
    assert cpu.verify_row_groups(cu, bad, lens, plan.begin) is None
    alone = cpu.attention_decode(q, k_pool, v_pool, bad, lens, 0.2, plan)
    forced = cpu.attention_decode(q, k_pool, v_pool, bad, lens, 0.2, plan, cu)
    assert not torch.equal(forced[1], alone[1]) and torch.equal(forced[4:], alone[4:])
    late = plan.begin.clone()
    late[2] += 1  # rows of a request that begin their own keys at different places
    assert cpu.verify_row_groups(cu, table, lens, late) is None


def test_attention_decode_reads_only_each_requests_keys():
    """Negative controls: changing a key past a request's length (the padding slot of a
    shorter row) leaves its output alone, and changing one of its own keys moves it."""
    q, k_pool, v_pool, table, lens = _decode_case(3, 4, 2, 8, 8, [(4, 40), (2, 0)], 20)
    kernel = CpuBackend.attention_decode
    out = kernel(q, k_pool, v_pool, table, lens, 0.5)
    short = int(torch.argmin(lens))
    unused = sorted(set(range(k_pool.shape[0])) - set(table[short, : lens[short]].tolist()))
    k2 = k_pool.clone()
    k2[unused] += 5.0
    torch.testing.assert_close(kernel(q, k2, v_pool, table, lens, 0.5)[short], out[short])
    own_key = int(table[short, lens[short] - 1])
    v2 = v_pool.clone()
    v2[own_key] += 5.0
    assert not torch.allclose(kernel(q, k_pool, v2, table, lens, 0.5)[short], out[short])


def test_attention_decode_falls_back_and_checks_lengths():
    """fp16 pools (not covered; bf16 is, see test_kernels_bf16.py) go to the reference; a
    seq_len beyond the table is refused, not read."""
    q, k_pool, v_pool, table, lens = _decode_case(5, 4, 2, 8, 8, [(3, 40)], 10)
    kernel = CpuBackend.attention_decode
    ref = TorchBackend.attention_decode
    half = (q.half(), k_pool.half(), v_pool.half(), table, lens, 0.5)
    assert torch.equal(kernel(*half), ref(*half))
    bad = lens.clone()
    bad[0] = table.shape[1] + 1
    with pytest.raises(ValueError, match="exceeds the slot table"):
        kernel(q, k_pool, v_pool, table, bad, 0.5)


def test_moe_pad_and_unpad_match_reference():
    """Pairs placed in the same rows (pair order within an expert), padding rows zeroed, x
    given as strided rows; the weighted sums back match, and an expert without pairs is fine."""
    g = torch.Generator().manual_seed(11)
    T, K, E, H = 37, 3, 6, 24
    x = torch.randn(T, H + 5, generator=g)[:, 2 : 2 + H]
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # E-1 unused
    ref_buf, ref_pos = TorchBackend.moe_pad(x, ids, E)
    buf, pos = CpuBackend.moe_pad(x, ids, E)
    assert torch.equal(pos, ref_pos) and torch.equal(buf, ref_buf)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert buf.shape[1] == int(counts.max()) and counts[E - 1] == 0
    assert not buf[0, : counts[0]].eq(0).all()
    y = torch.randn(E, buf.shape[1], H, generator=g)
    w = torch.rand(T, K, generator=g)
    ref = TorchBackend.moe_unpad(y, ids, pos, w)
    out = CpuBackend.moe_unpad(y, ids, pos, w)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # the cpu pad's blocks are a strided view: unpad of a bmm over them still matches
    wts = torch.randn(E, H, H, generator=g)
    torch.testing.assert_close(
        CpuBackend.moe_unpad(torch.bmm(buf, wts), ids, pos, w),
        TorchBackend.moe_unpad(torch.bmm(ref_buf, wts), ids, ref_pos, w),
        atol=1e-5,
        rtol=1e-5,
    )


def test_moe_pad_rejects_bad_ids_and_falls_back_for_bf16():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="outside 0..3"):
        CpuBackend.moe_pad(x, torch.tensor([[0, 1], [2, 4], [1, 3], [0, 2]]), 4)
    # an expert listed twice by every token would need more rows than its block has
    with pytest.raises(ValueError, match="repeats within a token"):
        CpuBackend.moe_pad(x, torch.tensor([[1, 1], [1, 1], [1, 1], [1, 1]]), 4)
    ids = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2]])
    buf, pos = CpuBackend.moe_pad(x.bfloat16(), ids, 4)
    ref_buf, ref_pos = TorchBackend.moe_pad(x.bfloat16(), ids, 4)
    assert buf.dtype == torch.bfloat16 and torch.equal(buf, ref_buf) and torch.equal(pos, ref_pos)


@pytest.mark.parametrize("zero_centered,rd", [(True, 8), (False, 16)])
def test_rms_norm_rope_matches_reference_on_strided_heads(zero_centered, rd):
    """Per-head norm + rotate-half RoPE of a partial (8 of 16) or full rotary dim, x's heads
    strided out of a wider projection (the k slice of a fused qkv row)."""
    g = torch.Generator().manual_seed(rd)
    T, H, D = 7, 3, 16
    x = torch.randn(T, 5 * H * D, generator=g)[:, H * D : 2 * H * D].reshape(T, H, D)
    assert x.stride() == (5 * H * D, D, 1)
    w = torch.randn(D, generator=g) * 0.2
    ang = torch.rand(T, rd // 2, generator=g) * 6
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    ref = TorchBackend.rms_norm_rope(x, w, 1e-6, zero_centered, cos, sin)
    out = CpuBackend.rms_norm_rope(x, w, 1e-6, zero_centered, cos, sin)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the rotation is real: with cos=1, sin=0 the result is the plain norm, which differs
    plain = TorchBackend.rms_norm(x, w, 1e-6, zero_centered)
    no_turn = CpuBackend.rms_norm_rope(x, w, 1e-6, zero_centered, cos * 0 + 1, sin * 0)
    torch.testing.assert_close(no_turn, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_conv_and_mamba2_steps_match_the_reference_in_place(dtype):
    """The ``cpu`` backend's conv and Mamba2 decode primitives run natively (no fallback) on
    row-strided views of a conv output, update only their slots, and match the reference."""
    from mambaradix.kernels.conv import causal_conv1d_update
    from mambaradix.kernels.mamba2 import mamba2_step

    if not native.available():
        pytest.skip("no C compiler here: the cpu backend runs the reference")
    g = torch.Generator().manual_seed(3)
    H, P, G, N = 8, 64, 2, 32
    pool = torch.randn(6, H, P, N, generator=g)
    before = pool.clone()
    slots = torch.tensor([4, 1])
    xbc = torch.randn(2, H * P + 2 * G * N, generator=g).to(dtype)
    x = xbc[:, : H * P].view(2, H, P)
    B = xbc[:, H * P : H * P + G * N].view(2, G, N)
    C = xbc[:, H * P + G * N :].view(2, G, N)
    dt, A = torch.rand(2, H, generator=g), -torch.rand(H, generator=g)
    D = torch.randn(H, generator=g).to(dtype)
    want_y, want_state = mamba2_step(pool[slots].clone(), x, dt, A, B, C, D)
    y = cpu.mamba2_step(pool, slots, x, dt, A, B, C, D)
    assert y is not None
    assert torch.allclose(y, want_y, atol=1e-4, rtol=1e-4)
    assert torch.allclose(pool[slots], want_state, atol=1e-5)
    others = [0, 2, 3, 5]
    assert torch.equal(pool[others], before[others])
    assert not torch.equal(pool[slots], before[slots])

    conv_pool = torch.randn(6, 40, 3, generator=g).to(dtype)
    w, bias = torch.randn(40, 4, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    xc = torch.randn(2, 40, generator=g).to(dtype)
    want, want_conv = causal_conv1d_update(xc, conv_pool[slots].clone(), w, bias, "silu")
    got = cpu.conv1d_update(xc, conv_pool, slots, w, bias, "silu")
    assert got is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(conv_pool[slots], want_conv)
