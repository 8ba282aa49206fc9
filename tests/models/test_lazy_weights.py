"""Checkpoint tensors are read straight into the parameter they fill: a fused projection's parts
into their rows, experts into their places in the stack, converted only where the dtype or
layout differs, and a truncated file is named before anything is read."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mambaradix.models import weights as W


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 8, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, 8, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 8, generator=g).to(torch.bfloat16),
        "f": torch.randn(4, 6, generator=g),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def scanned(path):
    return dict(W.scan_safetensors(path))


def no_own_buffer(monkeypatch):
    """Reading a FileTensor into a buffer of its own (the conversion path) now raises."""

    def refuse(self):
        raise AssertionError(f"{self.name} was read into a buffer of its own")

    monkeypatch.setattr(W.FileTensor, "tensor", refuse)


def test_file_tensor_reads_in_place_when_dtype_and_layout_match(ckpt, monkeypatch):
    path, ref = ckpt
    lazy = scanned(path)
    assert lazy["a"].shape == ref["a"].shape and lazy["a"].dtype == torch.bfloat16
    no_own_buffer(monkeypatch)
    out = torch.full((3, 8), 7.0, dtype=torch.bfloat16)
    lazy["a"].read_into(out)
    assert torch.equal(out, ref["a"])
    # control: another dtype needs the conversion buffer, which the patch refuses
    with pytest.raises(AssertionError, match="buffer of its own"):
        lazy["a"].read_into(torch.empty(3, 8))


def test_file_tensor_converts_dtype_and_layout(ckpt):
    path, ref = ckpt
    lazy = scanned(path)
    out = torch.empty(3, 8)  # float32 from bf16
    lazy["a"].read_into(out)
    assert torch.equal(out, ref["a"].float())
    strided = torch.empty(8, 3, dtype=torch.bfloat16).t()  # non-contiguous
    lazy["a"].read_into(strided)
    assert torch.equal(strided, ref["a"])
    with pytest.raises(W.CheckpointError, match="read into"):
        lazy["a"].read_into(torch.empty(8, 3, dtype=torch.bfloat16))


def test_concat_reads_each_part_into_its_rows(ckpt, monkeypatch):
    path, ref = ckpt
    lazy = scanned(path)
    fused = W.Concat([lazy["a"], lazy["b"], lazy["c"]])
    assert fused.shape == (10, 8) and fused.dtype == torch.bfloat16
    no_own_buffer(monkeypatch)
    out = torch.empty(fused.shape, dtype=fused.dtype)
    fused.read_into(out)
    assert torch.equal(out, torch.cat([ref["a"], ref["b"], ref["c"]]))
    # control: parts in another order give another tensor
    other = torch.empty_like(out)
    W.Concat([lazy["b"], lazy["a"], lazy["c"]]).read_into(other)
    assert not torch.equal(other, out)
    with pytest.raises(W.CheckpointError, match="cannot fuse"):
        W.Concat([lazy["a"], lazy["f"]])


def test_concat_of_plain_tensors_and_mixed_dtypes(ckpt):
    path, ref = ckpt
    lazy = scanned(path)
    plain = torch.randn(2, 8)
    fused = W.Concat([lazy["a"], plain])
    assert fused.dtype == torch.float32  # promoted, as torch.cat would
    assert torch.equal(fused.tensor(), torch.cat([ref["a"].float(), plain]))


def test_stack_fills_the_parameter_layout_experts_use(ckpt):
    path, ref = ckpt
    lazy = scanned(path)
    stack = W.Stack([W.Concat([lazy["a"], lazy["c"]]), W.Concat([lazy["c"], lazy["a"]])])
    assert stack.shape == (2, 5, 8)
    out = torch.empty(2, 8, 5, dtype=torch.bfloat16).transpose(1, 2)  # a strided parameter
    stack.read_into(out)
    want = torch.stack([torch.cat([ref["a"], ref["c"]]), torch.cat([ref["c"], ref["a"]])])
    assert torch.equal(out, want)
    with pytest.raises(W.CheckpointError, match="cannot stack"):
        W.Stack([lazy["a"], lazy["b"]])


def test_stack_expert_weights_names_and_values(ckpt):
    path, ref = ckpt
    lazy = scanned(path)
    per_expert = [
        ("m.experts.0.gate_proj.weight", lazy["a"]),
        ("m.experts.1.gate_proj.weight", lazy["a"]),
        ("m.experts.0.up_proj.weight", lazy["c"]),
        ("m.experts.1.up_proj.weight", lazy["c"]),
        ("m.experts.0.down_proj.weight", lazy["b"]),
        ("other.weight", lazy["f"]),
    ]
    out = dict(W.stack_expert_weights(per_expert, lambda prefix: 2 if prefix == "m.experts" else 0))
    assert out["other.weight"] is lazy["f"]
    gate_up = out["m.experts.gate_up_proj"].tensor()
    assert torch.equal(gate_up[1], torch.cat([ref["a"], ref["c"]]))
    # an incomplete block (one down_proj of two) is an error naming what is missing
    with pytest.raises(W.CheckpointError, match="expected 2 down_proj"):
        dict(W.stack_expert_weights(per_expert))


def test_mapped_applies_its_row_permutation(ckpt):
    path, ref = ckpt
    lazy = scanned(path)
    rows = torch.tensor([2, 0, 1])
    m = W.Mapped(lazy["a"], lambda w: w.index_select(0, rows))
    assert torch.equal(m.tensor(), ref["a"][rows])


def test_truncated_file_is_named_before_reading(ckpt, tmp_path):
    path, _ = ckpt
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(W.CheckpointError, match="cut.safetensors is truncated"):
        list(W.scan_safetensors(cut))
