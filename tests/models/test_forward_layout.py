"""The per-forward layout (``layout.py``): what it holds, and that a forward builds its metadata
once, not once per layer."""

from __future__ import annotations

import sys

import pytest
import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardReq
from mambaradix.kernels import torch_backend
from mambaradix.kernels.torch_backend import TorchBackend
from mambaradix.layout import ForwardContext, ForwardLayout, RowSet
from mambaradix.models.registry import get_model_class
from mambaradix.models.tiny_configs import _tiny_qwen3_next


def _reqs(decodes_first: bool = True) -> list[ForwardReq]:
    dec = [
        ForwardReq(4, [3], torch.arange(5), 0, [(1, 7)]),
        ForwardReq(6, [4], torch.arange(10, 17), 1),
    ]
    pre = [
        ForwardReq(0, [5, 6, 7], torch.arange(20, 23), 2, [(2, 8)]),
        ForwardReq(2, [8, 9], torch.arange(30, 34), 3, [(1, 9), (2, 10)], all_logits=True),
    ]
    return dec + pre if decodes_first else [pre[0], dec[0], pre[1], dec[1]]


def test_layout_splits_decodes_and_prefill_segments() -> None:
    lay = ForwardLayout.build(_reqs())
    assert lay.input_ids.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert lay.positions.tolist() == [4, 6, 0, 1, 2, 2, 3]
    assert lay.out_kv_slots.tolist() == [4, 16, 20, 21, 22, 32, 33]
    dec, pre = lay.decode, lay.prefill
    assert dec.reqs == [0, 1] and dec.rows.span == (0, 2)
    assert dec.state_slots.tolist() == [0, 1] and dec.seq_lens.tolist() == [5, 7]
    assert dec.snapshot_rows.tolist() == [0] and dec.snapshot_slots.tolist() == [7]
    assert dec.kv_table[1, :7].tolist() == list(range(10, 17))
    assert pre.cu_seqlens.tolist() == [0, 3, 5] and pre.rows.span == (2, 7)
    assert pre.prefix_lens == [0, 2] and pre.state_slots.tolist() == [2, 3]
    assert list(zip(pre.snapshot_seqs, pre.snapshot_offsets)) == [(0, 2), (1, 1), (1, 2)]
    assert pre.snapshot_slots.tolist() == [8, 9, 10]
    # logits: each request's last token, all tokens of the all_logits one
    assert lay.logit_rows.tolist() == [0, 1, 4, 5, 6]
    assert ForwardLayout.build(_reqs()[:2]).logit_rows is None  # all decodes: every row


def test_rows_in_any_order_take_and_put_the_same_rows() -> None:
    lay = ForwardLayout.build(_reqs(decodes_first=False))
    assert lay.decode.rows.span is None and lay.decode.rows.index.tolist() == [3, 6]
    x = torch.arange(7.0)[:, None]
    assert lay.decode.rows.take(x)[:, 0].tolist() == [3.0, 6.0]
    assert lay.prefill.rows.take(x)[:, 0].tolist() == [0.0, 1.0, 2.0, 4.0, 5.0]
    out = torch.zeros(7, 1)
    lay.decode.rows.put(out, torch.ones(2, 1))
    assert out[:, 0].tolist() == [0, 0, 0, 1, 0, 0, 1]
    whole = RowSet.of([0, 1, 2], 3, "cpu")
    three = x[:3]
    assert whole.whole and whole.take(three) is three


def _count(monkeypatch, module, name: str, calls: dict) -> None:
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("decodes_first", [True, False])
def test_a_forward_builds_its_plans_once_for_all_layers(monkeypatch, decodes_first) -> None:
    """Tiny Qwen3-Next (3 Gated DeltaNet layers, 1 attention layer): each index plan of the
    reference backend is built once per forward, and no layer or model code makes an index
    tensor (``torch.tensor`` / ``torch.arange``) while it runs."""
    config, _ = _tiny_qwen3_next("tiny")
    torch.manual_seed(0)
    model = get_model_class(config.architectures or ["Qwen3NextForCausalLM"])(config).eval()
    kinds = config.layer_types
    assert kinds.count("linear_attention") >= 2 and "full_attention" in kinds
    kv = KVPool(model.kv_spec, 64, 1)
    states = StatePool(model.state_spec, 12)
    reqs = _reqs(decodes_first)
    for r in reqs:  # real slots of the pools
        r.kv_slots = r.kv_slots % 64
    calls: dict[str, int] = {}
    for name in ("_gdn_buckets", "_conv_rows", "_decode_plan", "_prefill_groups"):
        _count(monkeypatch, torch_backend, name, calls)
    layout = ForwardLayout.build(reqs)
    backend = TorchBackend()
    model.use_backend(backend)
    backend.prepare(layout)

    made_in_layers: list[str] = []
    real_tensor, real_arange = torch.tensor, torch.arange

    def watch(real):
        def f(*args, **kwargs):
            where = sys._getframe(1).f_code.co_filename
            if "/mambaradix/layers/" in where or "/mambaradix/models/" in where:
                made_in_layers.append(where)
            return real(*args, **kwargs)

        return f

    monkeypatch.setattr(torch, "tensor", watch(real_tensor))
    monkeypatch.setattr(torch, "arange", watch(real_arange))
    logits = model(ForwardContext(layout, kv, states))
    monkeypatch.undo()
    assert logits.shape[0] == 5
    assert calls == {"_gdn_buckets": 1, "_conv_rows": 1, "_decode_plan": 1, "_prefill_groups": 1}
    assert made_in_layers == []
