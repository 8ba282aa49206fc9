"""Published configurations (``models/published_configs.py``): each builds, loads and runs.

Default run: every published config with its layer count cut to one layer of each kind (the
published layer pattern's first layers, kinds it would lose put back at the end), vocabulary
cut to 1,024 and routed experts to 4 (top-k at most 4): hidden sizes, head counts and head
dims, state shapes and the MLP / expert widths are the published ones. Each is saved as a bf16
checkpoint, loaded with ``--dtype auto`` (bf16), and served through the Engine (a prefill, decode
steps, an exact repeat that resumes from the cache) with the integrity check after every step;
the smaller ones are also compared with transformers' bf16 logits. The 9B-class widths (hidden
4096-4480) build in ~10 s each here and run only under ``-m slow``, as do all configs with
their published vocabulary and expert counts. Unsupported architectures fail with the list of
supported ones."""

from __future__ import annotations

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from test_bf16_oracle import ATOL

from mambaradix.engine.engine import Engine
from mambaradix.models.loader import load_model
from mambaradix.models.published import build_published, cut_fields, get_published
from mambaradix.models.published_configs import PUBLISHED, UNSUPPORTED
from mambaradix.models.registry import UnsupportedArchitectureError, supported_architectures

WIDE = {"qwen3_5_9b", "granite_4_0_h_small", "nemotron_h_8b", "nemotron_nano_9b_v2"}
HF_COMPARE_MAX_PARAMS = 200e6  # transformers' bf16 forward beside ours where this is cheap
CUT = dict(vocab=1024, experts=4)


def kinds_of(fields: dict) -> list[str]:
    """Each layer's kind (Falcon-H1 has one: every layer is hybrid)."""
    kinds = fields.get("layer_types") or fields.get("layers_block_type")
    return kinds or ["hybrid"] * fields["num_hidden_layers"]


def min_layers(name: str) -> int:
    return len(set(kinds_of(get_published(name).fields)))


def run_fixture(name: str, folder, vocab: int | None, experts: int | None) -> None:
    """Build the cut checkpoint in ``folder``, serve it, and delete it (a full-size one is
    gigabytes: pytest keeps three runs' temporary folders, and killed runs filled the disk)."""
    try:
        _run_fixture(name, folder, vocab, experts)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run_fixture(name: str, folder, vocab: int | None, experts: int | None) -> None:
    layers = min_layers(name)
    build_published(name, folder, layers=layers, vocab=vocab, experts=experts)
    fields = cut_fields(get_published(name), layers=layers, vocab=vocab, experts=experts)
    assert sorted(set(kinds_of(fields))) == sorted(set(kinds_of(get_published(name).fields)))
    # bf16 as published ("auto" picks fp32 on CPUs without bf16 matmuls: test_loading)
    model = load_model(str(folder), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.vocab_size == fields["vocab_size"]
    assert len(model.state_spec.layers) >= 1 and model.kv_spec is not None

    rng = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.vocab_size, (80,), generator=rng).tolist()
    params = dict(temperature=0.0, max_new_tokens=4, ignore_eos=True, return_logprob=True)
    with Engine(
        model=model,
        tokenizer=None,
        debug_integrity=True,
        skip_warmup=True,
        max_total_tokens=2048,
        max_mamba_cache_size=16,
        chunked_prefill_size=64,
    ) as eng:
        first = eng.generate(input_ids=prompt, sampling_params=params)
        again = eng.generate(input_ids=prompt, sampling_params=params)
        eng.check_integrity()
    for out in (first, again):
        assert len(out["output_ids"]) == 4
        assert all(math.isfinite(lp) for lp in out["meta_info"]["output_token_logprobs"])
    assert again["meta_info"]["cached_tokens"] >= 64  # the repeat resumed from a snapshot

    n_params = sum(p.numel() for p in model.parameters())
    if n_params <= HF_COMPARE_MAX_PARAMS:
        compare_with_transformers(model, folder, prompt[:24])


def compare_with_transformers(model, folder, prompt: list[int]) -> None:
    """Our bf16 logits of a prompt vs transformers' bf16 ones (tolerance of test_bf16_oracle)."""
    from transformers import AutoModelForCausalLM

    from mambaradix.cache.kv_pool import KVPool
    from mambaradix.cache.state_pool import StatePool
    from mambaradix.core import ForwardReq
    from mambaradix.layout import ForwardContext

    kv = KVPool(model.kv_spec, 64)
    states = StatePool(model.state_spec, 1)
    states.clear([0])
    req = ForwardReq(0, prompt, torch.arange(len(prompt)), 0)
    ours = model(ForwardContext.build([req], kv, states), all_logits=True)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        pos = torch.arange(len(prompt))[None]
        theirs = hf(input_ids=torch.tensor([prompt]), position_ids=pos).logits[0]
    diff = (ours.float().log_softmax(-1) - theirs.float().log_softmax(-1)).abs().max().item()
    assert diff <= ATOL, f"logprobs differ from transformers' bf16 by {diff:.3f} > {ATOL}"


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) - WIDE))
def test_published_config_cut_builds_and_serves(name, tmp_path):
    run_fixture(name, tmp_path / name, **CUT)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WIDE))
def test_published_config_wide_cut_builds_and_serves(name, tmp_path):
    run_fixture(name, tmp_path / name, **CUT)


# one at a time across the workers (tests/conftest.py's _big_memory): two at once came near
# 24 GB of RAM (Qwen3.5-4B's alone reached 14 GB, Qwen3-Next-80B's 17) and a worker was killed
@pytest.mark.slow
@pytest.mark.big_memory
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_full_vocab_and_experts(name, tmp_path):
    run_fixture(name, tmp_path / name, vocab=None, experts=None)


def test_cut_keeps_every_layer_kind_and_published_widths():
    for name, pub in PUBLISHED.items():
        fields = cut_fields(pub, layers=min_layers(name), **CUT)
        assert set(kinds_of(fields)) == set(kinds_of(pub.fields)), name
        assert len(kinds_of(fields)) == min_layers(name), name
        for key, value in pub.fields.items():
            if key not in ("layer_types", "layers_block_type", "num_hidden_layers", "vocab_size",
                           "pad_token_id", "bos_token_id", "eos_token_id",
                           "num_experts", "num_local_experts", "n_routed_experts",
                           "num_experts_per_tok", "mlp_only_layers",
                           "num_dense_layers"):  # fmt: skip
                assert fields[key] == value, (name, key)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the cut wrap
            if isinstance(pub.fields.get(key), int):
                assert fields[key] == pub.fields[key] % fields["vocab_size"], (name, key)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_published_architecture_is_one_clear_error(name, tmp_path):
    model_type, arch = UNSUPPORTED[name]
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": model_type, "architectures": [arch]})
    )
    with pytest.raises(UnsupportedArchitectureError) as err:
        load_model(str(tmp_path))
    message = str(err.value)
    assert arch in message
    for supported in supported_architectures():
        assert supported in message
