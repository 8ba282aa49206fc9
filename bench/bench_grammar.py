"""Per-token cost of grammar masks on CPU: xgrammar (engine/grammar.py) vs llguidance.

For each vocabulary (the tiny checkpoint's tokenizer, and a byte-level BPE tokenizer of
``--large-vocab`` ordinary tokens built like bench_real.py's and cached under /tmp) and each
library it prints, in a fixed format:

- setup: tokenizer-info build, first compile of the schema, a cached compile (engine/grammar's
  LRU for xgrammar);
- b1: one request: mask computation + apply to a float32 logits row (the engine's path for a
  batch of one), µs per token (median and p90 over ``--steps`` greedy steps on seeded random
  logits, a fresh matcher when it ends);
- b16: 16 requests in one batched call (multi-threaded fill + one apply over 16 rows), µs per
  decode step and per token; then the step split into fill and apply (the engine's
  ``apply_bitmask_rows``), beside xgrammar's own CPU apply kernel on the same masks.

    python bench/bench_grammar.py                    # tiny + 151,936-token vocabulary
    python bench/bench_grammar.py --large-vocab 248320 --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": ["string", "null"], "maxLength": 32},
        "active": {"type": "boolean"},
        "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "active", "roles", "address"],
    "additionalProperties": False,
}


def large_tokenizer_cached(vocab_size: int) -> Any:
    from transformers import PreTrainedTokenizerFast

    folder = Path(f"/tmp/mambaradix-bench-grammar-tok-{vocab_size}")
    if not (folder / "tokenizer.json").is_file():
        from bench_real import large_tokenizer

        large_tokenizer(vocab_size).save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _stats(samples_us: list[float]) -> tuple[float, float]:
    s = sorted(samples_us)
    return statistics.median(s), s[int(0.9 * (len(s) - 1))]


def bench_xgrammar(tok: Any, vocab: int, steps: int, batch: int) -> dict[str, float]:
    import xgrammar as xgr

    from mambaradix.engine.grammar import (
        GrammarCompiler,
        GrammarMatcher,
        GrammarSpec,
        apply_bitmask_rows,
    )

    t0 = time.perf_counter()
    comp = GrammarCompiler(tok, vocab, max_threads=2)
    t1 = time.perf_counter()
    spec = GrammarSpec.from_json_schema(SCHEMA)
    comp.compile(spec)
    t2 = time.perf_counter()
    comp.compile(spec)
    t3 = time.perf_counter()
    out = {"info_ms": (t1 - t0) * 1e3, "compile_ms": (t2 - t1) * 1e3, "cached_ms": (t3 - t2) * 1e3}
    g = torch.Generator().manual_seed(0)
    compiled = comp.compile(spec)
    m = GrammarMatcher(compiled, vocab)
    one = comp.allocate_bitmask(1)
    samples = []
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=g)
        a = time.perf_counter()
        comp.fill_masks([m], one, [0])
        apply_bitmask_rows(logits, one, vocab, {0: 0})
        samples.append((time.perf_counter() - a) * 1e6)
        m.accept(int(logits.argmax()))
        if m.is_terminated():
            m = GrammarMatcher(compiled, vocab)
    out["b1_med_us"], out["b1_p90_us"] = _stats(samples)
    ms = [GrammarMatcher(compiled, vocab) for _ in range(batch)]
    bitmask = comp.allocate_bitmask(batch)
    rows = list(range(batch))
    samples, fills, applies, xgr_applies = [], [], [], []
    for _ in range(max(1, steps // 4)):
        logits = torch.randn(batch, vocab, generator=g)
        a = time.perf_counter()
        comp.fill_masks(ms, bitmask, rows)
        b = time.perf_counter()
        apply_bitmask_rows(logits, bitmask, vocab, {r: r for r in rows})
        c = time.perf_counter()
        samples.append((c - a) * 1e6)
        fills.append((b - a) * 1e6)
        applies.append((c - b) * 1e6)
        # the same masks by xgrammar's own CPU kernel (every bit of every row), same run
        again = torch.randn(batch, vocab, generator=g)
        d = time.perf_counter()
        xgr.apply_token_bitmask_inplace(again, bitmask, vocab_size=vocab)
        xgr_applies.append((time.perf_counter() - d) * 1e6)
        for r, mm in enumerate(ms):
            mm.accept(int(logits[r].argmax()))
            if mm.is_terminated():
                ms[r] = GrammarMatcher(compiled, vocab)
    out["bN_med_us"], out["bN_p90_us"] = _stats(samples)
    out["fill_med_us"] = _stats(fills)[0]
    out["apply_med_us"] = _stats(applies)[0]
    out["xgr_apply_med_us"] = _stats(xgr_applies)[0]
    comp.close()
    return out


def bench_llguidance(tok: Any, vocab: int, steps: int, batch: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    m = llguidance.LLMatcher(lltok, grammar)
    t2 = time.perf_counter()
    llguidance.LLMatcher(lltok, grammar)
    t3 = time.perf_counter()
    out = {"info_ms": (t1 - t0) * 1e3, "compile_ms": (t2 - t1) * 1e3, "cached_ms": (t3 - t2) * 1e3}
    if m.is_error():
        raise RuntimeError(m.get_error())
    g = torch.Generator().manual_seed(0)
    bitmask = lt.allocate_token_bitmask(1, vocab)
    samples = []
    for _ in range(steps):
        logits = torch.randn(1, vocab, generator=g)
        a = time.perf_counter()
        lt.fill_next_token_bitmask(m, bitmask, 0)
        lt.apply_token_bitmask_inplace(logits, bitmask)
        samples.append((time.perf_counter() - a) * 1e6)
        m.consume_token(int(logits.argmax()))
        if m.is_stopped() or m.is_error():
            m.reset()
    out["b1_med_us"], out["b1_p90_us"] = _stats(samples)
    ms = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    executor = llguidance.LLExecutor(num_threads=2)
    bitmask = lt.allocate_token_bitmask(batch, vocab)
    samples = []
    for _ in range(max(1, steps // 4)):
        logits = torch.randn(batch, vocab, generator=g)
        a = time.perf_counter()
        lt.fill_next_token_bitmask_par(executor, [(mm, r) for r, mm in enumerate(ms)], bitmask)
        lt.apply_token_bitmask_inplace(logits, bitmask)
        samples.append((time.perf_counter() - a) * 1e6)
        for r, mm in enumerate(ms):
            mm.consume_token(int(logits[r].argmax()))
            if mm.is_stopped() or mm.is_error():
                mm.reset()
    out["bN_med_us"], out["bN_p90_us"] = _stats(samples)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large-vocab", type=int, default=151_936)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--libs", default="xgrammar,llguidance")
    args = ap.parse_args()
    torch.set_num_threads(2)
    from mambaradix.models.loader import load_tokenizer, resolve_model_path

    toks = [("tiny", load_tokenizer(resolve_model_path("tiny:qwen3_next")))]
    if args.large_vocab:
        toks.append((f"bpe{args.large_vocab}", large_tokenizer_cached(args.large_vocab)))
    benches = {"xgrammar": bench_xgrammar, "llguidance": bench_llguidance}
    print(f"schema: {len(json.dumps(SCHEMA))}-char object schema, compact JSON; threads=2")
    for name, tok in toks:
        vocab = len(tok)
        for lib in args.libs.split(","):
            r = benches[lib](tok, vocab, args.steps, args.batch)
            print(
                f"{name:<10} vocab={vocab:>6} {lib:<10} setup: info {r['info_ms']:8.1f} ms "
                f"compile {r['compile_ms']:8.1f} ms cached {r['cached_ms']:7.2f} ms | "
                f"b1 {r['b1_med_us']:8.1f} us/tok (p90 {r['b1_p90_us']:8.1f}) | "
                f"b{args.batch} {r['bN_med_us']:8.1f} us/step (p90 {r['bN_p90_us']:8.1f}) "
                f"= {r['bN_med_us'] / args.batch:7.1f} us/tok"
            )
            if "fill_med_us" in r:
                speedup = r["xgr_apply_med_us"] / max(r["apply_med_us"], 1e-9)
                print(
                    f"{'':<10} b{args.batch} split: fill {r['fill_med_us']:8.1f} us, apply "
                    f"{r['apply_med_us']:8.1f} us (xgrammar's CPU kernel on the same masks: "
                    f"{r['xgr_apply_med_us']:8.1f} us, {speedup:.1f}x)"
                )


if __name__ == "__main__":
    main()
