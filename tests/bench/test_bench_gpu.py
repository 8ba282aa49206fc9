"""``bench/bench_gpu.py --dry-run``: the GPU benchmark's every part, run on the CPU at toy sizes,
so that a mistake in the script is found here rather than in a GPU's few minutes.

Its figures mean nothing here (the engine runs its CPU backend, the kernels' comparisons run
under Triton's interpreter, a CPU has no graphs and no syncs to count); what the test checks is
that each part ran and wrote its records, and the one figure that is exact on any device: W1's
computed prompt tokens equal the ideal. The first dry run found two mistakes that would have
cost a GPU run every preset's figures after its start (a ``SamplingParams`` where ``generate``
takes a dict; ``device_map`` without ``accelerate`` installed): both now fail this test.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "bench_gpu.py"


def _bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu_dry", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_gpu_benchmark_runs_every_part_in_a_dry_run(tmp_path, capsys) -> None:
    bench = _bench_gpu()
    out = tmp_path / "out" / "gpu.jsonl"
    bench.main(["--dry-run", "--root", str(tmp_path / "ckpt"), "--out", str(out)])
    assert capsys.readouterr().out.rstrip().endswith("done")
    lines = out.read_text().splitlines()
    assert lines == [json.dumps(r) for r in bench.RECORDS]  # what was printed, in order
    records = [json.loads(line) for line in lines]
    bad = [r for r in records if r["what"] in ("error", "skipped") or r["what"].endswith("_error")]
    assert not bad, bad
    by = {(r["preset"], r["what"]): r for r in records}
    assert by["machine", "limits"]["hbm_read_bytes_s"] > 0
    dry = bench.DRY_RUN
    for preset in dry["presets"]:
        _assert_preset_ran(by, preset, dry)
    shapes, long = bench.DRY_KERNELS["mamba2"]
    for name in shapes:
        for what in (f"mamba2_1x{long}", f"mamba2_16x{long // 16}"):
            r = by[name, what]
            assert r["sequential_ms"] > 0 and r["chunked_ms"] > 0
            assert r["picks"] in ("chunked", "sequential")
    # issue 31's goals, one record per preset measured, each judged against its threshold
    goals = [r for r in records if r["what"] == "goal"]
    long = max(dry["prefill_lens"])
    want = {"decode_b1.of_hbm_limit", f"prefill_{long}.of_bf16_limit", "hf_w1.ours_speedup",
            "decode_syncs.per_step"}  # fmt: skip
    assert {(g["preset"], g["figure"]) for g in goals} == {
        (p, f) for p in dry["presets"] for f in want
    }
    for g in goals:
        what, field = g["figure"].split(".")
        sense, threshold = g["threshold"].split()
        value = by[g["preset"], what][field]
        assert g["value"] == value
        assert g["met"] == (
            value >= float(threshold) if sense == ">=" else value <= float(threshold)
        )
    shapes, batches = bench.DRY_KERNELS["moe"]
    for name in shapes:
        for b in batches:
            r = by[name, f"moe_b{b}"]
            assert r["triton_ms"] > 0 and r["reference_ms"] > 0 and r["of_hbm_limit"] > 0
    for hq, hkv, d in bench.DRY_KERNELS["attention"][0]:
        r = by[f"attn_{hq}x{hkv}x{d}", "prefill_tiles"]
        tiles = ["default", *("x".join(map(str, t)) for t in bench.ATTENTION_TILES)]
        assert all(r[f"ms_{t}"] > 0 and r[f"sdpa_over_{t}"] > 0 for t in tiles)


def test_the_gpu_benchmarks_default_presets_exist() -> None:
    """The dry run cuts two of the three presets; the third (a 9B shape) must at least name a
    published configuration and a tokenizer class."""
    from mambaradix.models.published import get_published

    bench = _bench_gpu()
    presets = bench.parser().get_default("presets")
    assert "qwen3_5_9b" in presets
    for preset in presets:
        assert get_published(preset).fields and preset in bench.TOKENIZER_CLASS


def _assert_preset_ran(by: dict, preset: str, dry: dict) -> None:
    start = by[preset, "start"]
    assert start["backend"] == "cpu"
    assert (start["chunk"], start["forward_tokens"]) == (512, 4096)  # (the CPU's sizes)
    hf_load = by[preset, "hf_load"]
    assert hf_load["path"] in ("device_map", "host_then_moved") and "fla" in hf_load["kernels"]
    assert hf_load["ours_start_over_it"] > 0
    for n in dry["prefill_lens"]:
        assert by[preset, f"prefill_{n}"]["tok_s"] > 0
        assert by[preset, f"prefill_{n}"]["of_bf16_limit"] > 0
        assert by[preset, f"hf_prefill_{n}"]["ours_over_it"] > 0
    for b in dry["batches"]:
        assert by[preset, f"decode_b{b}"]["tok_s"] > 0
        assert (b == 1) == ("of_hbm_limit" in by[preset, f"decode_b{b}"])
        assert by[preset, f"decode_eager_b{b}"]["graphs_over_eager"] > 0
    assert by[preset, "hf_decode_b1"]["ours_over_it"] > 0
    assert by[preset, "decode_syncs"]["per_step"] == 0  # nothing counts them on a CPU
    w1 = by[preset, "w1"]
    # every group's system prompt (a multiple of the snapshot stride) computed once
    assert w1["computed_prompt_tokens"] == w1["ideal_tokens"] > 0
    assert by[preset, "hf_w1"]["ours_speedup"] > 0


def test_the_benchmark_tokenizer_draws_what_random_choice_draws() -> None:
    """``bench_real.large_tokenizer`` draws its merges with ``rng.choice`` inlined (for speed):
    the same merges as ``random.Random(0).choice``, so the presets' cached tokenizers stay the
    ones a fresh build makes (checked once against the cached 248,320-token one by hand)."""
    import random
    import sys

    sys.path.insert(0, str(BENCH.parent))
    from bench_real import large_tokenizer
    from tokenizers import pre_tokenizers

    from mambaradix.models.tiny import SPECIAL_TOKENS

    size = 2000
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tokens, rng = sorted(pre_tokenizers.ByteLevel.alphabet()), random.Random(0)
    while len(vocab) < size:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if len(a) + len(b) <= 12 and a + b not in vocab:
            vocab[a + b] = len(vocab)
            tokens.append(a + b)
    got = large_tokenizer(size).get_vocab()
    assert {t: i for t, i in got.items() if t in vocab} == vocab and len(got) == size
