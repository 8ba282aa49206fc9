"""Checkpoint loading: shards, rope layouts, Qwen3.5 multimodal layout, errors, tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardReq
from mambaradix.layout import ForwardContext
from mambaradix.models.loader import (
    CheckpointError,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from mambaradix.models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    supported_architectures,
)
from mambaradix.models.tiny import make_tiny_checkpoint, tiny_archs

TOKENS = list(range(3, 200, 7))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("loader") / "qwen3_5"
    make_tiny_checkpoint("qwen3_5", str(folder), seed=3)
    return folder


def logits(model) -> torch.Tensor:
    kv = KVPool(model.kv_spec, 64)
    st = StatePool(model.state_spec, 2)
    req = ForwardReq(0, TOKENS, torch.arange(len(TOKENS)), 0)
    return model(ForwardContext.build([req], kv, st), all_logits=True)


def clone(base: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(base, dst)
    return dst


def edit_config(folder: Path, fn) -> None:
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def test_sharded_safetensors_equal_single_file(base, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / f, sharded / f)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    assert torch.equal(logits(load_model(str(sharded))), logits(load_model(str(base))))
    # a shard listed in the index but missing is named in the error
    victim = sorted(set(index["weight_map"].values()))[0]
    (sharded / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        load_model(str(sharded))


def test_rope_theta_top_level_equals_rope_parameters(base, tmp_path):
    flat = clone(base, tmp_path, "flat")

    def to_flat(cfg):
        rp = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rp["rope_theta"]
        cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]

    edit_config(flat, to_flat)
    ref = logits(load_model(str(base)))
    assert torch.allclose(logits(load_model(str(flat))), ref, atol=1e-6)
    # control: the rope setting is really read (another theta changes the logits)
    other = clone(base, tmp_path, "other_theta")
    edit_config(other, lambda c: c["rope_parameters"].update(rope_theta=10.0))
    assert not torch.allclose(logits(load_model(str(other))), ref, atol=1e-3)


def test_qwen3_5_multimodal_layout(base, tmp_path):
    """Qwen3_5ForConditionalGeneration: text_config + weights under model.language_model.,
    vision and mtp weights ignored."""
    mm = tmp_path / "mm"
    mm.mkdir()
    text = json.loads((base / "config.json").read_text())
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64},
        "tie_word_embeddings": False,
    }
    (mm / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(base / "model.safetensors"))
    out = {
        (f"model.language_model.{k[len('model.') :]}" if k.startswith("model.") else k): v
        for k, v in sd.items()
    }
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    out["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(out, str(mm / "model.safetensors"))
    model = load_model(str(mm))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert torch.allclose(logits(model), logits(load_model(str(base))), atol=1e-6)


def test_unsupported_architecture_names_it_and_supported(base, tmp_path):
    bad = clone(base, tmp_path, "llama")
    edit_config(bad, lambda c: c.update(architectures=["MysteryForCausalLM"]))
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(str(bad))
    assert "MysteryForCausalLM" in str(e.value) and "Qwen3NextForCausalLM" in str(e.value)
    assert {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"} <= set(supported_architectures())
    with pytest.raises(UnsupportedArchitectureError, match="architectures"):
        get_model_class([])


def test_missing_and_malformed_files(base, tmp_path):
    with pytest.raises(CheckpointError, match="not a folder"):
        load_model(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(str(empty))
    noweights = clone(base, tmp_path, "noweights")
    (noweights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(str(noweights))
    broken = clone(base, tmp_path, "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(str(broken))
    notype = clone(base, tmp_path, "notype")
    edit_config(notype, lambda c: c.pop("model_type"))
    with pytest.raises(CheckpointError, match="model_type"):
        load_model(str(notype))
    wrong = clone(base, tmp_path, "wrong_shape")
    edit_config(wrong, lambda c: c.update(intermediate_size=c["intermediate_size"] * 2))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(str(wrong))


def test_tokenizer_roundtrip_specials_and_chat_template(base):
    tok = load_tokenizer(str(base))
    model = load_model(str(base))
    assert len(tok) == model.vocab_size
    for text in ("hello world", "héllo wörld 🙂 ∑ 中文 \n\t  x", "model cache 1234!"):
        assert tok.decode(tok(text)["input_ids"]) == text
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert len(set(ids.values())) == 3 and all(i < model.vocab_size for i in ids.values())
    assert set(model.eos_token_ids) == {ids["<|endoftext|>"], ids["<|im_end|>"]}
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    enc = tok(chat)["input_ids"]
    assert enc[0] == ids["<|im_start|>"] and ids["<|im_end|>"] in enc


def test_resolve_tiny_spec_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MAMBARADIX_CACHE", str(tmp_path))
    path = resolve_model_path("tiny:qwen3_next")
    assert Path(path).parent == tmp_path and (Path(path) / "config.json").exists()
    stamp = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("tiny:qwen3_next") == path
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == stamp
    assert load_model("tiny:qwen3_next").vocab_size == 512
    with pytest.raises(CheckpointError, match="available"):
        resolve_model_path("tiny:nonexistent")
    assert {"qwen3_next", "qwen3_5"} <= set(tiny_archs())


def test_tiny_cli_writes_a_loadable_checkpoint(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli"
    subprocess.run(
        [sys.executable, "-m", "mambaradix.models.tiny", "--arch", "qwen3_next", "--out", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert load_model(str(out)).vocab_size == 512 and (out / "tokenizer.json").exists()


def test_bfloat16_weights_and_ssm_dtype(base):
    ref = logits(load_model(str(base)))
    model = load_model(str(base), dtype=torch.bfloat16, ssm_dtype=torch.bfloat16)
    assert model.kv_spec.dtype == torch.bfloat16
    assert {s.temporal_dtype for s in model.state_spec.layers} == {torch.bfloat16}
    out = logits(model).float()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
