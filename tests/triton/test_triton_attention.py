"""The Triton paged attention (``kernels/triton/attention.py``) against the torch reference
(``kernels/attention.py``): prefill segments with and without cached prefixes, decodes of one
key, of a length off the key block, and over several splits; GQA; fp32 and bf16.

Without a GPU the kernels run on CPU tensors under the interpreter (``conftest.py``). Its limit
that matters here: it holds bf16 values as numpy ``uint16`` bit patterns, and unpatched its
``tl.dot`` multiplies those raw bits (results ~1e10). The bf16 tests rely on the shim
(``interpreter.py``) widening bf16 operands to fp32 and rounding results back to nearest even,
as a GPU's tensor cores and conversions do; ``test_interpreter_bf16_dot_is_faithful`` checks
that precondition on its own, so a shim without it fails there by name. Not emulated: the order
of the fp32 sums, hence bf16 is compared at bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from mambaradix.kernels import attention as reference
from mambaradix.kernels.triton import attention as triton_attention
from mambaradix.kernels.triton.attention import AttentionTiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.3
SMALL = AttentionTiles(block_m=16, block_n=16)  # several key blocks at tiny shapes
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    tol = TOLERANCE[got.dtype]
    return got.dtype == want.dtype and torch.allclose(
        got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol
    )


def _pools(size: int, hkv: int, d: int, dv: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(size, hkv, d, generator=gen).to(dtype)
    v = torch.randn(size, hkv, dv, generator=gen).to(dtype)
    return k, v, gen


def _prefill_case(segs, hkv=2, group=2, d=32, dv=32, dtype=torch.float32, size=400, seed=0):
    """Segments ``(new tokens, prefix)`` over shuffled slots; a table padded with slot 0. Returns
    the kernel's inputs (on DEVICE) and each segment's slots."""
    k, v, gen = _pools(size, hkv, d, dv, dtype, seed)
    perm = torch.randperm(size, generator=gen)
    slots, used = [], 0
    for n, prefix in segs:
        slots.append(perm[used : used + prefix + n])
        used += prefix + n
    width = max(len(s) for s in slots) + 3  # wider than any row: padding is read as unused
    table = torch.zeros(len(segs), width, dtype=torch.int32)
    for p, s in enumerate(slots):
        table[p, : len(s)] = s.to(torch.int32)
    lens = [n for n, _ in segs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hkv * group, d, generator=gen).to(dtype)
    prefix_lens = torch.tensor([p for _, p in segs], dtype=torch.int32)
    inputs = [t.to(DEVICE) for t in (q, k, v, cu, prefix_lens, table)]
    return inputs, slots, max(lens)


def _prefill_reference(q, k, v, cu, prefix_lens, slots) -> torch.Tensor:
    q, k, v, cu = q.cpu(), k.cpu(), v.cpu(), cu.tolist()
    outs = [
        reference.attention_prefill(q[cu[p] : cu[p + 1]], k, v, s, int(prefix_lens[p]), SCALE)
        for p, s in enumerate(slots)
    ]
    return torch.cat(outs)


def _dense_prefill(q, k, v, cu, prefix_lens, slots, shift: int) -> torch.Tensor:
    """Plain fp32 attention whose query ``i`` sees keys ``0 .. prefix + i + shift``: shift 0 is
    the contract, +-1 an off-by-one causal mask."""
    q, k, v, cu = q.cpu().float(), k.cpu().float(), v.cpu().float(), cu.tolist()
    group = q.shape[1] // k.shape[1]
    outs = []
    for p, s in enumerate(slots):
        qs = q[cu[p] : cu[p + 1]]
        ks = k[s].repeat_interleave(group, 1)  # [L, Hq, D]
        vs = v[s].repeat_interleave(group, 1)
        scores = torch.einsum("nhd,lhd->hnl", qs, ks) * SCALE
        pos = int(prefix_lens[p]) + torch.arange(qs.shape[0]) + shift
        keys = torch.arange(len(s))
        scores = scores.masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), vs))
    return torch.cat(outs)


def _decode_case(lens, hkv=2, group=2, d=32, dv=32, dtype=torch.float32, width=None, seed=1):
    size = 64 + sum(lens)
    k, v, gen = _pools(size, hkv, d, dv, dtype, seed)
    perm = torch.randperm(size, generator=gen)
    table = torch.zeros(len(lens), width or max(lens) + 5, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k, v, table, seq_lens)]


def _decode_reference(q, k, v, table, seq_lens) -> torch.Tensor:
    return reference.attention_decode(
        q.cpu(), k.cpu(), v.cpu(), table.cpu().long(), seq_lens.cpu().long(), SCALE
    )


# ---------------------------------------------------------------------------- prefill

SEGMENTS = [(5, 0), (1, 7), (37, 20), (16, 0)]  # no prefix, one token, several blocks, exact


@pytest.mark.parametrize("tiles", [None, SMALL], ids=["default", "small"])
def test_prefill_fp32(tiles):
    (q, k, v, cu, prefix_lens, table), slots, max_len = _prefill_case(SEGMENTS)
    got = triton_attention.paged_attention_prefill(
        q, k, v, cu, prefix_lens, table, SCALE, max_len, tiles=tiles
    )
    assert got.shape == (q.shape[0], q.shape[1], v.shape[-1]) and got.dtype == q.dtype
    assert _close(got, _prefill_reference(q, k, v, cu, prefix_lens, slots))


def test_prefill_splits_gqa4_strided_q():
    """Keys split three ways (merged), 4 query heads per KV head, a query that is a view into a
    wider projection output, Dv != D and a head size off a power of two."""
    segs = [(3, 40), (9, 0), (2, 19)]
    (q, k, v, cu, prefix_lens, table), slots, max_len = _prefill_case(
        segs, hkv=1, group=4, d=24, dv=40
    )
    wide = torch.zeros(q.shape[0], q.shape[1] + 2, q.shape[2], device=DEVICE)
    wide[:, 1:-1] = q
    view = wide[:, 1:-1]
    got = triton_attention.paged_attention_prefill(
        view, k, v, cu, prefix_lens, table, SCALE, max_len, tiles=SMALL, splits=3
    )
    assert _close(got, _prefill_reference(q, k, v, cu, prefix_lens, slots))


def test_prefill_bf16():
    (q, k, v, cu, prefix_lens, table), slots, max_len = _prefill_case(
        SEGMENTS, dtype=torch.bfloat16
    )
    got = triton_attention.paged_attention_prefill(
        q, k, v, cu, prefix_lens, table, SCALE, max_len, tiles=SMALL
    )
    assert got.dtype == torch.bfloat16
    assert _close(got, _prefill_reference(q, k, v, cu, prefix_lens, slots))
    # against exact fp32 attention over the same bf16 values: the kernel's only extra roundings
    # are the probabilities and the output
    dense = _dense_prefill(q, k, v, cu, prefix_lens, slots, shift=0)
    assert torch.allclose(got.float().cpu(), dense, atol=1e-2, rtol=1e-2)


def test_prefill_negative_controls():
    """The comparison catches a wrong key slot and a causal mask off by one either way."""
    (q, k, v, cu, prefix_lens, table), slots, max_len = _prefill_case(SEGMENTS)
    got = triton_attention.paged_attention_prefill(
        q, k, v, cu, prefix_lens, table, SCALE, max_len, tiles=SMALL
    )
    assert _close(got, _dense_prefill(q, k, v, cu, prefix_lens, slots, shift=0))
    for shift in (-1, 1):
        assert not _close(got, _dense_prefill(q, k, v, cu, prefix_lens, slots, shift=shift))
    unused = k.shape[0] - 1  # past every segment's slots
    wrong = table.clone()
    wrong[2, 3] = unused
    bad = triton_attention.paged_attention_prefill(
        q, k, v, cu, prefix_lens, wrong, SCALE, max_len, tiles=SMALL
    )
    assert not _close(bad, _prefill_reference(q, k, v, cu, prefix_lens, slots))


# ---------------------------------------------------------------------------- decode

LENS = [1, 17, 70, 32]  # one key, off the block, several splits' worth, a whole number of blocks


@pytest.mark.parametrize(
    "tiles,splits",
    [(None, None), (None, 1), (SMALL, 1), (SMALL, 3)],
    ids=["default", "unsplit", "small", "splits"],
)
def test_decode_fp32(tiles, splits):
    q, k, v, table, seq_lens = _decode_case(LENS)
    got = triton_attention.paged_attention_decode(
        q, k, v, table, seq_lens, SCALE, tiles=tiles, splits=splits
    )
    assert got.shape == (q.shape[0], q.shape[1], v.shape[-1]) and got.dtype == q.dtype
    assert _close(got, _decode_reference(q, k, v, table, seq_lens))


def test_decode_default_splits_small_batch():
    """One request over a 300-wide table: the heuristic splits the keys (two waves of 132
    multiprocessors wanted, at least 128 keys a split) and the merge is exact."""
    assert triton_attention.num_splits(2, 300, 64, torch.device(DEVICE)) == 2
    assert triton_attention.num_splits(2, 1 << 16, 64, torch.device(DEVICE)) > 16
    assert triton_attention.num_splits(512, 1 << 16, 64, torch.device(DEVICE)) == 1
    q, k, v, table, seq_lens = _decode_case([290], width=300)
    got = triton_attention.paged_attention_decode(q, k, v, table, seq_lens, SCALE)
    assert _close(got, _decode_reference(q, k, v, table, seq_lens))


def test_decode_gqa_heads_and_padding_row():
    """8 query heads per KV head (one block of rows), Dv != D, fp32 queries over fp32 pools,
    and a padding row (``seq_lens`` 0) that gets zeros."""
    q, k, v, table, seq_lens = _decode_case([5, 0, 40], hkv=1, group=8, d=16, dv=48)
    got = triton_attention.paged_attention_decode(q, k, v, table, seq_lens, SCALE, splits=2)
    assert torch.equal(got[1].cpu(), torch.zeros_like(got[1].cpu()))
    # the reference's CPU decode needs Dv == D: plain attention of each row's one query
    keep = [0, 2]
    lens = seq_lens.cpu()
    slots = [table[b, : int(lens[b])].cpu().long() for b in keep]
    cu = torch.arange(len(keep) + 1)
    want = _dense_prefill(q[keep], k, v, cu, lens[keep] - 1, slots, shift=0)
    assert _close(got[keep], want)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_bf16(splits):
    q, k, v, table, seq_lens = _decode_case(LENS, dtype=torch.bfloat16)
    got = triton_attention.paged_attention_decode(
        q, k, v, table, seq_lens, SCALE, tiles=SMALL, splits=splits
    )
    assert got.dtype == torch.bfloat16
    assert _close(got, _decode_reference(q, k, v, table, seq_lens))


def test_decode_negative_controls():
    """The comparison catches lengths off by one and a wrong table row."""
    q, k, v, table, seq_lens = _decode_case(LENS)
    got = triton_attention.paged_attention_decode(q, k, v, table, seq_lens, SCALE, splits=3)
    assert _close(got, _decode_reference(q, k, v, table, seq_lens))
    longer = table.clone()
    for b, n in enumerate(LENS):
        longer[b, n] = int(table[(b + 1) % len(LENS), 0])  # a real key past the row's end
    assert not _close(got, _decode_reference(q, k, v, longer, seq_lens + 1))
    shorter = (seq_lens - 1).clamp(min=1)
    assert not _close(got, _decode_reference(q, k, v, table, shorter))
    swapped = table[[1, 0, 2, 3]]  # rows 0 and 1 read each other's keys
    bad = triton_attention.paged_attention_decode(q, k, v, swapped, seq_lens, SCALE, splits=3)
    assert not _close(bad, _decode_reference(q, k, v, table, seq_lens))


# ---------------------------------------------------------------------------- interpreter


def test_interpreter_bf16_dot_is_faithful():
    """The precondition of the bf16 tests (on a GPU, a plain check of a bf16 ``tl.dot``): it
    multiplies bf16 values, not their bit patterns, into fp32."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        idx = r[:, None] * N + r[None, :]
        tl.store(c_ptr + idx, tl.dot(tl.load(a_ptr + idx), tl.load(b_ptr + idx)))

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=gen).bfloat16()
    b = torch.randn(16, 16, generator=gen).bfloat16()
    c = torch.empty(16, 16, device=DEVICE)
    dot[(1,)](a.to(DEVICE), b.to(DEVICE), c, N=16)
    assert torch.allclose(c.cpu(), a.float() @ b.float(), atol=1e-4, rtol=1e-4), (
        "tl.dot on bf16 is not faithful here: the interpreter shim must widen bf16 operands"
    )


# ---------------------------------------------------------------------------- GPU / real size


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_decode_replays_in_cuda_graph():
    """Captured once, replayed with other lengths and table rows: the grid never read them."""
    q, k, v, table, seq_lens = _decode_case([700, 3, 1000, 64], dtype=torch.bfloat16, width=1024)
    triton_attention.paged_attention_decode(q, k, v, table, seq_lens, SCALE)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_attention.paged_attention_decode(q, k, v, table, seq_lens, SCALE)
    _, _, _, table2, lens2 = _decode_case([1, 1000, 512, 129], dtype=torch.bfloat16, width=1024)
    table.copy_(table2)
    seq_lens.copy_(lens2)
    graph.replay()
    assert _close(out, _decode_reference(q, k, v, table, seq_lens))


@pytest.mark.slow
@pytest.mark.big_memory  # ~9.5 GB: not beside a full-size checkpoint's test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,group", [(256, 8), (128, 4)], ids=["qwen3.5", "granite"])
def test_real_shapes(dtype, d, group):
    """Real head sizes and groups (Qwen3.5: 256, 16 query heads over 2 KV heads; Granite: 128)
    at the default tiles: a prefill with a long cached prefix, decodes over 2,000 keys at small
    batch (split) and the same decodes in one program each (unsplit)."""
    segs = [(130, 0), (70, 900)]
    (q, k, v, cu, prefix_lens, table), slots, max_len = _prefill_case(
        segs, hkv=2, group=group, d=d, dv=d, dtype=dtype, size=1200
    )
    got = triton_attention.paged_attention_prefill(q, k, v, cu, prefix_lens, table, SCALE, max_len)
    assert _close(got, _prefill_reference(q, k, v, cu, prefix_lens, slots))
    q, k, v, table, seq_lens = _decode_case(
        [2000, 1, 777], hkv=2, group=group, d=d, dv=d, dtype=dtype, width=2048
    )
    want = _decode_reference(q, k, v, table, seq_lens)
    for splits in (None, 1):
        got = triton_attention.paged_attention_decode(
            q, k, v, table, seq_lens, SCALE, splits=splits
        )
        assert _close(got, want)
