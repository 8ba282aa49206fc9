"""The native prefill attention (``csrc/attention_prefill.c``, AVX-512 BF16 dot products on
bf16 pools): against a float64 softmax, at least as close as the torch reference; each query's
result the same bits however its prompt is cut into chunks, batched or threaded; and the cases
it leaves to the reference."""

from __future__ import annotations

import shutil

import pytest
import torch

from mambaradix.kernels import attention, cpu, native
from mambaradix.kernels.cpu_backend import CpuBackend
from mambaradix.kernels.torch_backend import TorchBackend


def _supported() -> bool:
    lib = native.load("attention_prefill") if shutil.which("cc") else None
    return lib is not None and bool(lib.attention_prefill_supported())


pytestmark = pytest.mark.skipif(
    not _supported(),
    reason="no C compiler, or a CPU without AVX-512 BF16 (the kernel is built only for it): "
    "prefill attention runs ATen's flash kernel here, which tests/models/test_attention.py covers",
)
BF = torch.bfloat16


def _case(seed, hq, hkv, d, dv, reqs, pool=1500):
    """Pools, queries and ``PrefillKeys`` for requests of (cached prefix, new tokens), each
    request's keys at random slots."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(pool, hkv, d, generator=g).to(BF)
    v_pool = torch.randn(pool, hkv, dv, generator=g).to(BF)
    perm = torch.randperm(pool, generator=g)
    cu, kv_cu, slots, at = [0], [0], [], 0
    for pre, n in reqs:
        slots.append(perm[at : at + pre + n])
        at += pre + n
        cu.append(cu[-1] + n)
        kv_cu.append(kv_cu[-1] + pre + n)
    keys = cpu.PrefillKeys(
        cu=torch.tensor(cu),
        prefix=torch.tensor([pre for pre, _ in reqs]),
        kv_cu=torch.tensor(kv_cu),
        slots=torch.cat(slots),
        longest=max(pre + n for pre, n in reqs),
    )
    q = (torch.randn(cu[-1], hq, d, generator=g) * 1.5).to(BF)
    return q, k_pool, v_pool, keys, slots


def _truth(q, k, v, positions, scale):
    """float64 softmax: q [n, Hq, D] at ``positions`` over k/v [S, Hkv, *] (GQA by repeat)."""
    r = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(r, 1), v.double().repeat_interleave(r, 1)
    s = torch.einsum("nhd,shd->hns", q.double(), k) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hns,shd->nhd", s.softmax(-1), v)


def _ulps(got, want, floor):
    """|got - want| in bf16 spacings at ``want`` (at least at ``floor``)."""
    mag = want.abs().clamp_min(floor)
    return (got.double() - want).abs() / torch.exp2(torch.floor(torch.log2(mag)) - 7)


# requests of (cached prefix, new tokens): one token, rows that are no multiple of 16, block
# edges (64 keys) crossed and met exactly, a long prefix with a short chunk, many rows
REQS = [(0, 1), (0, 70), (63, 1), (64, 65), (130, 17), (5, 200), (700, 3)]


@pytest.mark.parametrize(
    "hq,hkv,d,dv",
    [
        (8, 2, 256, 256),  # Qwen3.5 / Qwen3-Next: heads of 256, 4 query heads per KV head
        (12, 4, 64, 64),  # Granite-4.0-H
        (16, 8, 64, 64),  # LFM2
        (4, 4, 32, 32),  # no grouping
        (6, 2, 64, 96),  # values wider than keys
        (4, 2, 16, 16),  # the tiny test models' heads (a value row of 16: half a step)
    ],
)
def test_prefill_matches_float64_softmax(hq, hkv, d, dv):
    """Every request of a batch against a float64 softmax over its keys: within the output's
    bf16 rounding and the weights' (as ATen's kernel rounds them), and at least as close as
    the torch reference in bf16. Control: the truth with one key more visible per query is far
    outside the bound."""
    q, k_pool, v_pool, keys, slots = _case(d + hq, hq, hkv, d, dv, REQS)
    scale = d**-0.5
    out = cpu.attention_prefill(q, k_pool, v_pool, keys, scale)
    assert out is not None and out.dtype == BF and out.shape == (q.shape[0], hq, dv)
    err, ref_err, wrong = [], [], []
    for p, (pre, n) in enumerate(REQS):
        rows = slice(int(keys.cu[p]), int(keys.cu[p + 1]))
        k, v = k_pool[slots[p]], v_pool[slots[p]]
        pos = torch.arange(pre, pre + n)
        truth = _truth(q[rows], k, v, pos, scale)
        floor = truth.abs().mean()
        err.append(_ulps(out[rows], truth, floor).flatten())
        ref = attention.attention_prefill(q[rows], k_pool, v_pool, slots[p], pre, scale)
        ref_err.append(_ulps(ref, truth, floor).flatten())
        if pre + n > 1:  # one key more (the first query's next; the last sees a copy of key 0)
            kk = torch.cat([k, k[:1]]) if n == 1 else k
            vv = torch.cat([v, v[:1]]) if n == 1 else v
            wrong.append(_ulps(out[rows], _truth(q[rows], kk, vv, pos + 1, scale), floor).flatten())
    err, ref_err, wrong = torch.cat(err), torch.cat(ref_err), torch.cat(wrong)
    # ~0.25 ulp on average is the output's own rounding (uniform in [0, 1/2])
    assert err.max() <= 3 and err.mean() <= 0.3, (err.max(), err.mean())
    # (with values wider than keys the reference is plain softmax in fp32: 0.21 on average,
    # but up to 13 ulps where ours stays under 3)
    assert err.mean() <= ref_err.mean() + 0.05, (err.mean(), ref_err.mean())
    assert err.max() <= ref_err.max() + 0.5, (err.max(), ref_err.max())
    assert wrong.mean() > 5 * err.mean() and wrong.max() > 3, (wrong.mean(), wrong.max())


def test_prefill_gives_the_same_bits_however_the_prompt_is_cut():
    """A query's result depends on its keys and position alone: one 300-token prompt in one
    call, in three chunks (each over the cached keys before it), batched with other requests
    in another order, and on one thread: the same bits. (The torch reference changes its
    rounding with the cut: its cascades merge pieces that depend on it.)"""
    hq, hkv, d = 8, 2, 128
    q, k_pool, v_pool, keys, slots = _case(7, hq, hkv, d, d, [(0, 300), (40, 90), (0, 33)])
    s = slots[0]
    scale = d**-0.5
    whole = cpu.attention_prefill(q[:300], k_pool, v_pool, _keys([(0, 300)], [s]), scale)
    cuts = [(0, 64), (64, 100), (164, 136)]
    parts = [
        cpu.attention_prefill(
            q[pre : pre + n], k_pool, v_pool, _keys([(pre, n)], [s[: pre + n]]), scale
        )
        for pre, n in cuts
    ]
    assert torch.equal(torch.cat(parts), whole)
    # batched: the other requests first, then this one's middle chunk
    batch = [(40, 90), (0, 33), (64, 100)]
    qb = torch.cat([q[300:390], q[390:423], q[64:164]])
    out = cpu.attention_prefill(qb, k_pool, v_pool, _keys(batch, [*slots[1:], s[:164]]), scale)
    assert torch.equal(out[123:], whole[64:164])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.attention_prefill(q[:300], k_pool, v_pool, _keys([(0, 300)], [s]), scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, whole)
    # control: a cut that the reference takes as a cascade changes its bits
    ref_whole = attention.attention_prefill(q[:300], k_pool, v_pool, s, 0, scale)
    ref_cut = attention.attention_prefill(q[250:300], k_pool, v_pool, s, 250, scale)
    assert 250 >= attention.LONG_PREFIX * 50 and not torch.equal(ref_cut, ref_whole[250:])


def _keys(reqs, slots):
    cu, kv = [0], [0]
    for (pre, n), s in zip(reqs, slots):
        assert s.numel() == pre + n
        cu.append(cu[-1] + n)
        kv.append(kv[-1] + pre + n)
    return cpu.PrefillKeys(
        torch.tensor(cu), torch.tensor([p for p, _ in reqs]), torch.tensor(kv), torch.cat(slots),
        longest=max(p + n for p, n in reqs),
    )  # fmt: skip


def test_prefill_leaves_other_inputs_to_the_reference(monkeypatch):
    """fp32 pools, a value size the kernel does not take (not a multiple of 16), and the
    switch off: None, and the backend then gives the reference's results."""
    q, k_pool, v_pool, keys, _ = _case(3, 4, 2, 64, 64, [(10, 20)])
    assert cpu.attention_prefill(q, k_pool.float(), v_pool.float(), keys, 0.1) is None
    assert cpu.attention_prefill(q, k_pool, v_pool[..., :40].contiguous(), keys, 0.1) is None
    monkeypatch.setattr(cpu, "NATIVE_PREFILL_ATTENTION", False)
    assert cpu.attention_prefill(q, k_pool, v_pool, keys, 0.1) is None
    monkeypatch.undo()
    assert cpu.attention_prefill(q, k_pool, v_pool, keys, 0.1) is not None


def test_backend_prefill_runs_the_kernel_and_agrees_with_the_reference(monkeypatch):
    """``CpuBackend.paged_attention_prefill`` over a layout with a shared prefix group: the
    kernel's results (no reference call: it is made to raise), within rounding of the torch
    backend's cascades."""
    from types import SimpleNamespace

    q, k_pool, v_pool, keys, slots = _case(11, 8, 2, 64, 64, [(96, 40), (96, 24), (0, 50)])
    slots[1][:96] = slots[0][:96]  # the first two share their 96 cached keys
    seg = SimpleNamespace(
        cu_list=keys.cu.tolist(), prefix_lens=keys.prefix.tolist(), kv_slots=slots,
        lens=[40, 24, 50],
    )  # fmt: skip
    layout = SimpleNamespace(prefill=seg, meta=None)
    ref = _reference_prefill(q, k_pool, v_pool, seg)
    backend = CpuBackend()
    monkeypatch.setattr(backend, "_index", lambda _layout: _Index())
    monkeypatch.setattr(TorchBackend, "paged_attention_prefill", None)  # no fallback allowed
    out = backend.paged_attention_prefill(q, k_pool, v_pool, layout, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


class _Index(dict):
    def get(self, key, make):
        return self.setdefault(key, make())


def _reference_prefill(q, k_pool, v_pool, seg):
    outs = []
    for p in range(len(seg.lens)):
        rows = slice(seg.cu_list[p], seg.cu_list[p + 1])
        outs.append(
            attention.attention_prefill(
                q[rows], k_pool, v_pool, seg.kv_slots[p], seg.prefix_lens[p], 0.125
            )
        )
    return torch.cat(outs)


def test_gather_buffers_are_shared_and_their_old_contents_never_read():
    """A forward's attention layers share the gather buffers (one allocation per shape); what
    an earlier layer left there never reaches a result: filled with NaN between two calls, the
    second gives the same bits (a padding row left unwritten would turn the outputs NaN)."""
    # the shortest first: a later, longer request overwrites what an earlier one left unread
    q, k_pool, v_pool, keys, _ = _case(5, 8, 2, 64, 64, [(0, 33), (70, 9), (129, 2)])
    first = cpu.attention_prefill(q, k_pool, v_pool, keys, 0.125)
    (buf,) = keys.buffers.values()
    buf.fill_(float("nan"))
    again = cpu.attention_prefill(q, k_pool, v_pool, keys, 0.125)
    assert keys.buffers[2, 64, 64] is buf and torch.equal(again, first)
    assert not again.isnan().any()
    # another head shape: a buffer of its own
    q2, k2, v2, _, _ = _case(5, 4, 4, 32, 32, [(70, 9), (0, 33), (129, 2)])
    cpu.attention_prefill(q2, k2, v2, keys, 0.125)
    assert len(keys.buffers) == 2 and keys.buffers[2, 64, 64] is buf


def test_the_engine_prefills_through_the_kernel(monkeypatch):
    """A bf16 model on the cpu backend runs its prefill attention here (a change that made the
    kernel stop applying would pass every equivalence test and only lose speed): every
    prefill forward's attention calls return the kernel's output, none the reference's."""
    from mambaradix.engine.engine import Engine
    from mambaradix.models.loader import load_model, resolve_model_path

    calls = {"native": 0, "reference": 0}
    native_call = cpu.attention_prefill

    def counted(*args, **kwargs):
        out = native_call(*args, **kwargs)
        calls["native" if out is not None else "reference"] += 1
        return out

    monkeypatch.setattr(cpu, "attention_prefill", counted)
    model = load_model(resolve_model_path("tiny:qwen3_5"), dtype="bfloat16")
    with Engine(
        model=model, tokenizer=None, kernel_backend="cpu", skip_warmup=True, debug_integrity=True
    ) as eng:
        assert eng.kernel_backend == "cpu"
        prompt = [(i * 37) % 400 + 5 for i in range(150)]
        eng.generate(input_ids=[prompt, prompt[:90] + [7, 8, 9]], sampling_params={
            "max_new_tokens": 3, "temperature": 0, "ignore_eos": True,
        })  # fmt: skip
        eng.check_integrity()
    assert calls["native"] > 0 and calls["reference"] == 0, calls
