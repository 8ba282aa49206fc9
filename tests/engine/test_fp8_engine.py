"""``--quantization fp8`` through the engine: outputs never depend on the cache.

- fp32 activations: the fp8 weights dequantize exactly, so the equivalence is the fp32 matrix's
  (``equivalence_helpers``: ids, and logprobs within 1e-4), on a Gated DeltaNet and a Mamba2
  hybrid, several strategies, pages and chunkings, against the cache-off reference of the same
  quantized model.
- bf16 activations (the C kernel for decode rows, dequantize-and-matmul for prefill): the bf16
  engine's tolerances (``test_bf16_engine``), with its zeroed-resume control failing them.
"""

from __future__ import annotations

import pytest
from equivalence_helpers import MAX_TIES, REFERENCE, compare, run, workload
from test_bf16_engine import CONFIGS, MEAN_ATOL, compare_bf16, run_bf16, zeroed_resumes
from test_bf16_engine import REFERENCE as BF16_REFERENCE

from mambaradix.kernels.fp8 import Fp8Weight
from mambaradix.models.loader import load_model, load_tokenizer, resolve_model_path

FP32_CONFIGS = [
    dict(mamba_scheduler_strategy="no_buffer", page_size=1, chunked_prefill_size=64),
    dict(mamba_scheduler_strategy="extra_buffer", page_size=16, chunked_prefill_size=-1),
    dict(
        mamba_scheduler_strategy="extra_buffer",
        page_size=1,
        chunked_prefill_size=64,
        disable_overlap_schedule=True,
    ),  # fmt: skip
]


def _quantized(arch: str, dtype: str = "auto"):
    path = resolve_model_path(f"tiny:{arch}")
    model = load_model(path, dtype=dtype, quantization="fp8")
    assert any(isinstance(m.weight, Fp8Weight) for m in model.modules() if hasattr(m, "weight"))
    return model, load_tokenizer(path)


@pytest.mark.parametrize("arch", ["qwen3_next", "granite_hybrid", "granite_hybrid_moe"])
def test_fp8_fp32_cache_on_equals_off(arch):
    model, tok = _quantized(arch)
    prompts = workload(model.vocab_size, n=80, seed=5)
    ref, _ = run(model, tok, prompts, REFERENCE)
    for flags in FP32_CONFIGS:
        got, hits = run(model, tok, prompts, flags)
        assert hits > 0, flags
        ties, worst = compare(ref, got)
        assert ties <= MAX_TIES, (flags, ties)


@pytest.fixture(scope="module")
def fp8_bf16(tmp_path_factory):
    """Qwen3.5-0.8B's published widths cut to 4 layers and a 4,096 vocabulary (as
    ``test_bf16_engine``'s real shape: the tiny model's logprobs hardly depend on its states,
    so its zeroed control passes), fp8 linears: every decode linear runs the C kernel."""
    from mambaradix.kernels import fp8
    from mambaradix.models.published import build_published

    folder = tmp_path_factory.mktemp("qwen3_5_0_8b_cut_fp8")
    build_published("qwen3_5_0_8b", folder, layers=4, vocab=4096)
    model = load_model(str(folder), dtype="bfloat16", quantization="fp8")
    assert any(isinstance(getattr(m, "weight", None), Fp8Weight) for m in model.modules())
    if fp8._native() is None:
        print("no fp8 C kernel on this CPU: the reference ran")
    prompts = workload(model.vocab_size, n=16, seed=3)
    ref, _ = run_bf16(model, prompts, BF16_REFERENCE)
    return model, prompts, ref


def test_fp8_bf16_cache_on_matches_off(fp8_bf16):
    model, prompts, ref = fp8_bf16
    for flags in CONFIGS[1::2]:  # (both strategies, pages 16)
        got, hits = run_bf16(model, prompts, flags)
        assert hits > 0, flags
        rep = compare_bf16(ref, got)
        print(f"\nhits {hits} {rep} under {flags}")
        rep.check()


def test_fp8_bf16_zeroed_resumes_fail_the_check(fp8_bf16, monkeypatch):
    model, prompts, ref = fp8_bf16
    zeroed_resumes(monkeypatch)
    got, hits = run_bf16(model, prompts, CONFIGS[3])
    assert hits > 0
    rep = compare_bf16(ref, got)
    with pytest.raises(AssertionError):
        rep.check()
    assert rep.wide or rep.mean > MEAN_ATOL, rep


def test_the_quantization_flag():
    import argparse

    from mambaradix.config import EngineConfig, add_config_args, config_from_args

    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig)
    cfg = config_from_args(EngineConfig, parser.parse_args(["--quantization", "fp8"]))
    assert cfg.quantization == "fp8"
    assert config_from_args(EngineConfig, parser.parse_args([])).quantization == ""
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])  # a choice the engine does not have


def test_an_engine_with_fp8_weights_generates():
    from mambaradix.engine.engine import Engine

    with Engine(model_path="tiny:lfm2", dtype="bfloat16", quantization="fp8",
                debug_integrity=True) as eng:
        out = eng.generate("Hello", {"max_new_tokens": 4, "temperature": 0})
        assert len(out["output_ids"]) == 4
        assert sum(isinstance(m, Fp8Weight) for m in eng.model.modules()) > 0
