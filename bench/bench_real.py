"""Real-size benchmark: the Engine on checkpoints shaped like published ones (random weights
saved in bf16, the published dimensions and vocabulary; computed in bf16 where the CPU has
bf16 matmuls, else fp32, both engines alike), against transformers on the same folder and
threads, and against the machine's own limits measured in the same run.

Per preset it prints, in a fixed format:
- start: process start to engine ready (warm-up included; median of ``--starts`` fresh
  processes), beside transformers' ``from_pretrained`` of the same folder (also fresh processes);
- first request after start vs the same request later (median over the fresh starts);
- prefill tok/s of one 512- and one 2,048-token prompt (the Engine, cache off), vs
  transformers' forward, and vs the matmul limit: the best matmul FLOP/s of the dtype paths the
  engine may take (bf16 itself, or fp32 on bf16 copies) / (2 x linear parameters)
  (matmul FLOP/s: the median of six readings, one before each of the prefill runs);
- decode tok/s at batch 1, 16 and 64 (the Engine: from the outputs' arrival times once every
  request of the batch decodes, so prefill drops out), vs transformers' cached decode (batch 1
  and 16), and batch 1 vs the bandwidth limit: read GB/s / bytes a decode step reads (the
  median of three runs, each against a bandwidth reading taken just before it);
- W1: 4 groups x 8 requests of a 512-token system prompt + 64-token question, 16 new tokens,
  all sent at once, cache on: wall time and computed prompt tokens vs the ideal, and
  transformers ``generate`` in batches of 8.

    python bench/bench_real.py                       # every preset, 2 threads
    python bench/bench_real.py --presets qwen3_5_0_8b --starts 1 --skip-hf
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

CACHE = Path(os.environ.get("MAMBARADIX_CACHE", Path.home() / ".cache" / "mambaradix"))

# Published configurations (models/published_configs.py), full size: random weights in bf16,
# the published dimensions, layer pattern and vocabulary.
PRESETS = ("qwen3_5_0_8b", "lfm2_350m", "granite_4_0_h_350m")
# run only when named (--presets): a mixture of experts (7B, 1B active: 14 GB), and Falcon-H1
# (attention and Mamba2 in every layer)
MORE_PRESETS = ("granite_4_0_h_tiny", "falcon_h1_0_5b", "olmo_hybrid_7b")


# --------------------------------------------------------------------------- checkpoints


def large_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ordinary tokens, as published
    tokenizers are (tiny.build_tokenizer fills a large vocabulary with added special tokens,
    which transformers then takes ~25 s to load at 248k): the ChatML specials, the 256 byte
    symbols and seeded synthetic merges of existing tokens."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mambaradix.models.tiny import SPECIAL_TOKENS

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tokens = sorted(alphabet)
    merges: list[tuple[str, str]] = []
    # rng.choice(tokens) inlined (the same draws: CPython's _randbelow_with_getrandbits), as
    # ~99% of the pairs drawn are rejected: 42M draws for 248k tokens, 31 s through choice()
    getrandbits = random.Random(0).getrandbits
    while len(vocab) < vocab_size:
        n = len(tokens)
        k = n.bit_length()
        i = getrandbits(k)
        while i >= n:
            i = getrandbits(k)
        j = getrandbits(k)
        while j >= n:
            j = getrandbits(k)
        a, b = tokens[i], tokens[j]
        if len(a) + len(b) > 12 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        tokens.append(a + b)
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for t in SPECIAL_TOKENS:
        tok.add_special_tokens([t])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def checkpoint(preset: str) -> Path:
    """The preset's bf16 checkpoint folder (built once: seeded random weights of the published
    configuration, a tokenizer of the full vocabulary)."""
    from mambaradix.models.published import build_published

    folder = CACHE / f"real-{preset}-v2"
    if (folder / "config.json").is_file():
        published_tokenizer_config(folder, preset)
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    build_published(preset, tmp)
    config = json.loads((tmp / "config.json").read_text())
    tok = large_tokenizer(config["vocab_size"])
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    config.update(eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(tmp)
    published_tokenizer_config(tmp, preset)
    tmp.rename(folder)
    return folder


# the tokenizer class each family's published tokenizer_config.json names
TOKENIZER_CLASS = {
    "qwen3_5_0_8b": "Qwen2Tokenizer",
    "lfm2_350m": "TokenizersBackend",
    "granite_4_0_h_350m": "GPT2Tokenizer",
    "granite_4_0_h_tiny": "GPT2Tokenizer",
    "falcon_h1_0_5b": "PreTrainedTokenizerFast",
    "olmo_hybrid_7b": "GPT2Tokenizer",
}


def decode_engine(preset: str, threads: int):
    """An ``Engine`` on the preset's checkpoint for decode measurements: bf16, cache off."""
    from mambaradix.engine.engine import Engine

    return Engine(model_path=str(checkpoint(preset)), num_threads=threads,
                  disable_radix_cache=True, dtype="bfloat16")  # fmt: skip


def published_tokenizer_config(folder: Path, preset: str) -> None:
    """Write tokenizer_config.json as published checkpoints have it: the family's tokenizer
    class and ``added_tokens_decoder`` (transformers 5's save_pretrained leaves the latter out,
    and without it transformers takes a legacy path that parses the whole tokenizer.json in
    Python: +1.2-1.6 s at 248k tokens, which no published checkpoint pays)."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if "added_tokens_decoder" in cfg:
        return
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    cfg["tokenizer_class"] = TOKENIZER_CLASS[preset]
    cfg["added_tokens_decoder"] = {
        str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added
    }
    path.write_text(json.dumps(cfg, indent=2))


# --------------------------------------------------------------------------- machine limits


def read_bandwidth(threads: int) -> float:
    """Bytes/s of torch.sum over a 1 GiB fp32 tensor, best of 5 (fp32: torch's bf16 sum
    converts as it goes and measures that instead)."""
    torch.set_num_threads(threads)
    x = torch.ones(1 << 28, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * x.element_size() / best


def matmul_limit(
    threads: int, dtype: torch.dtype, shapes: list[tuple[int, int, int]] = ()
) -> float:
    """The best matmul FLOP/s any path the engine may take for ``dtype`` reaches here: its own
    matmul and, for bf16 / fp16, an fp32 matmul (the engine computes large bf16 matmuls as fp32
    ones of bf16 copies where this CPU runs those faster, ``kernels/bf16_matmul.py``; the copies'
    cost left out, so this bounds that path from above), each over a square 2,048 matmul and the
    engine's own linear shapes ``(rows, in, out)``, ``F.linear`` as the engine calls it."""
    paths = [dtype] if dtype == torch.float32 else [dtype, torch.float32]
    return max(matmul_flops(threads, d, shape) for d in paths for shape in [None, *shapes])


def matmul_flops(
    threads: int, dtype: torch.dtype, shape: tuple[int, int, int] | None = None
) -> float:
    """FLOP/s of a 2,048 x 2,048 matmul in ``dtype`` (or ``F.linear`` of ``(rows, in, out)``),
    best of 5."""
    torch.set_num_threads(threads)
    m, k, n = shape or (2048, 2048, 2048)
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype) if shape else torch.randn(k, n).to(dtype)
    run = (lambda: torch.nn.functional.linear(a, b)) if shape else (lambda: a @ b)
    run()
    return 2 * m * k * n / min(_timed(run) for _ in range(5))


def linear_shapes(folder: Path, tokens: list[int]) -> list[tuple[int, int, int]]:
    """The prefill's largest linear shapes ``(rows, in, out)``: the MLP's up and down
    projections at each token count (a MoE's expert rows differ; its shared sizes stand in)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    hidden = cfg["hidden_size"]
    inter = cfg.get("intermediate_size") or cfg.get("block_ff_dim") or 4 * hidden
    return [s for n in tokens for s in ((n, hidden, inter), (n, inter, hidden))]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_figures(model: torch.nn.Module) -> tuple[int, int, int]:
    """(bytes a batch-1 decode step reads: every linear weight incl. the LM head, norms, convs,
    one embedding row and, of a mixture of experts, the routed experts' share of the stacks
    (``routed_share``); parameters of the linear layers a token computes with, incl. the LM head
    (of the experts, the routed share); the LM head's)."""
    read = linear = head = 0
    share = routed_share(model)
    for name, p in model.named_parameters():
        if "embed" in name and p.dim() == 2:
            read += p.shape[1] * p.element_size()  # one row per token
            if getattr(model, "lm_head", None) is None or _tied(model):
                linear += p.numel()  # tied: the LM head reads all of it
                head += p.numel()
                read += p.numel() * p.element_size()
            continue
        used = share if _is_expert(name, p) else 1.0
        read += int(p.numel() * p.element_size() * used)
        if p.dim() >= 2 and "conv" not in name:
            linear += int(p.numel() * used)
            head += p.numel() if name.startswith("lm_head") else 0
    from mambaradix.kernels.fp8 import Fp8Weight

    for mod in model.modules():  # --quantization fp8: codes and scales are buffers
        if isinstance(mod, Fp8Weight):
            used = share if mod.q.dim() == 3 else 1.0  # a stack of routed experts
            read += int((mod.q.numel() + mod.scale.numel() * mod.scale.element_size()) * used)
            linear += int(mod.q.numel() * used)
    return read, linear, head


def routed_share(model: torch.nn.Module) -> float:
    """The share of a mixture of experts' expert weights one token reads: top-k / experts
    (1 for a dense model)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    experts = max(
        getattr(cfg, k, 0) or 0 for k in ("num_local_experts", "num_experts", "n_routed_experts")
    )
    top_k = getattr(cfg, "num_experts_per_tok", 0) or 0
    return top_k / experts if experts and top_k else 1.0


def _is_expert(name: str, p: torch.Tensor) -> bool:
    """A routed expert's weights: a 3-D stack (the shared expert is 2-D), or one of a list
    (``experts.<e>.``: a model keeping one module per expert)."""
    if ".experts." in name and name.split(".experts.")[1].split(".")[0].isdigit():
        return True
    return p.dim() == 3 and ("experts" in name or "block_sparse_moe" in name)


def _tied(model: torch.nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    emb = next((p for n, p in model.named_parameters() if "embed" in n), None)
    return head is not None and emb is not None and head.weight.data_ptr() == emb.data_ptr()


# --------------------------------------------------------------------------- start-up


START_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
from mambaradix.engine.engine import Engine
eng = Engine(model_path=sys.argv[1], num_threads=int(sys.argv[2]), dtype=sys.argv[3])
ready = time.perf_counter()
ids = list(range(100, 612))
p = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
t = time.perf_counter()
eng.generate(input_ids=ids, sampling_params=p)
first = time.perf_counter() - t
later = []
for k in range(3):
    other = [i + 1000 * (k + 1) for i in ids]  # the same shape, nothing cached
    t = time.perf_counter(); eng.generate(input_ids=other, sampling_params=p)
    later.append(time.perf_counter() - t)
eng.shutdown()
print(json.dumps({"start": ready - t0, "first": first, "later": min(later)}))
"""

HF_LOAD_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[2]))
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[3]))
print(json.dumps({"load": time.perf_counter() - t0}))
"""

MATMUL_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[4])
from bench_real import linear_shapes, matmul_limit
shapes = linear_shapes(sys.argv[1], [512, 2048])
print(json.dumps({"flops": matmul_limit(int(sys.argv[2]), getattr(torch, sys.argv[3]), shapes)}))
"""

BANDWIDTH_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[4])
from bench_real import read_bandwidth
print(json.dumps({"read_bytes_s": read_bandwidth(int(sys.argv[2]))}))
"""


def fresh(script: str, folder: Path, threads: int, dtype: str) -> dict[str, float]:
    """Run ``script`` in a new interpreter (the clock starts at its first line)."""
    here = str(Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", script, str(folder), str(threads), dtype, here],
        capture_output=True, text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- engine figures


def engine_prefill(eng, n: int, vocab: int, repeats: int) -> float:
    p = {"temperature": 0, "max_new_tokens": 1}
    best = float("inf")
    for k in range(repeats):
        ids = [(i * 7919 + k * 104729) % (vocab - 10) + 5 for i in range(n)]
        best = min(best, _timed(lambda ids=ids: eng.generate(input_ids=ids, sampling_params=p)))
    return n / best


def engine_decode(eng, batch: int, vocab: int, steps: int, seed: int) -> float:
    """Decode tok/s at ``batch``: ``batch`` 128-token prompts (cache off) each generating
    ``steps + 1`` tokens; counted from the moment the last of them got its first token (all
    are decoding from then on) to the end, from the outputs' arrival times."""
    import threading

    from mambaradix.core import SamplingParams

    ids = [[(i * 31 + b * 977 + seed) % (vocab - 10) + 5 for i in range(128)] for b in range(batch)]
    p = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
    handles = eng.submit_many(ids, [p] * batch)
    arrivals: list[list[tuple[float, int]]] = [[] for _ in handles]

    def watch(i: int) -> None:
        for out in handles[i].events():
            arrivals[i].append((time.perf_counter(), len(out.new_token_ids)))

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(next(t for t, n in a if n) for a in arrivals)
    end = max(a[-1][0] for a in arrivals)
    tokens = sum(n for a in arrivals for t, n in a if t > start)
    return tokens / max(end - start, 1e-9)


def w1_workload(vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(1)
    tok = lambda k: [rng.randrange(5, vocab - 5) for _ in range(k)]  # noqa: E731
    systems = [tok(512) for _ in range(4)]
    return [systems[g] + tok(64) for g in range(4) for _ in range(8)]


def engine_w1(eng, prompts: list[list[int]]) -> tuple[float, int]:
    before = eng.stats().computed_prefill_tokens
    p = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    t = _timed(lambda: eng.generate(input_ids=prompts, sampling_params=[p] * len(prompts)))
    return t, eng.stats().computed_prefill_tokens - before


# --------------------------------------------------------------------------- transformers


def hf_prefill(hf, n: int, vocab: int) -> float:
    ids = torch.tensor([[(i * 7919) % (vocab - 10) + 5 for i in range(n)]])
    with torch.inference_mode():
        hf(input_ids=ids, logits_to_keep=1)
        return n / min(_timed(lambda: hf(input_ids=ids, logits_to_keep=1)) for _ in range(2))


def hf_decode(hf, batch: int, vocab: int, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(5, vocab - 5, (batch, 128))
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(input_ids=ids, position_ids=torch.arange(128)[None].expand(batch, -1), cache=cache,
           use_cache=True, logits_to_keep=1)  # fmt: skip
        tok = torch.ones(batch, 1, dtype=torch.long)
        t0 = time.perf_counter()
        for s in range(steps):
            pos = torch.full((batch, 1), 128 + s)
            hf(input_ids=tok, position_ids=pos, cache=cache, use_cache=True)
        return batch * steps / (time.perf_counter() - t0)


def hf_w1(hf, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), 8):
            batch = torch.tensor(prompts[i : i + 8])
            hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=16,
                        min_new_tokens=16, do_sample=False)  # fmt: skip
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- main


def line(preset: str, what: str, **fields: Any) -> None:
    body = " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
    )
    print(f"preset={preset:<20} {what:<14} {body}", flush=True)


def run_preset(preset: str, args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from mambaradix.engine.engine import Engine

    folder = checkpoint(preset)
    bar = tqdm(total=6, desc=preset, disable=args.disable_tqdm, leave=False)
    dtype = args.dtype
    for f in folder.iterdir():  # both sides start from a warm page cache, not whoever runs first
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    starts = [fresh(START_SCRIPT, folder, args.threads, dtype) for _ in range(args.starts)]
    hf_loads = [] if args.skip_hf else [fresh(HF_LOAD_SCRIPT, folder, args.threads, dtype)["load"]
                                        for _ in range(args.starts)]  # fmt: skip
    bar.update()
    start = statistics.median(s["start"] for s in starts)
    first = statistics.median(s["first"] / s["later"] for s in starts)
    line(preset, "start", seconds=start,
         hf_load_seconds=statistics.median(hf_loads) if hf_loads else float("nan"),
         ratio_to_hf=start / statistics.median(hf_loads) if hf_loads else float("nan"),
         first_request_over_later=first)  # fmt: skip
    # Every engine figure first, then transformers' in the same process: a transformers model
    # loaded (and run) beside the engine slowed its batch-1 decode by ~20% here (16 against 20
    # tok/s), which would charge transformers' presence to us.
    eng = Engine(
        model_path=str(folder), num_threads=args.threads, disable_radix_cache=True, dtype=dtype
    )
    read_bytes, linear_params, head_params = weight_figures(eng.model)
    vocab = eng.model.vocab_size
    # Prefill against the matmul limit read during this preset (matmul_limit: the best path the
    # engine may take for the dtype, over its own linear shapes too): one machine's bf16 matmul
    # measured 399-866 GFLOP/s on one day, so a single reading at the start of the run gave
    # "of limit" figures above 1. Each length runs three times, each after a matmul reading in
    # a process of its own; the limit is the best of the six readings and "of limit" the best
    # run over it (a median reading against the best run went above 1: not a bound).
    prefill, prefill_flops = {}, []
    for n in (512, 2048):
        runs = []
        for _ in range(3):
            prefill_flops.append(fresh(MATMUL_SCRIPT, folder, args.threads, dtype)["flops"])
            runs.append(engine_prefill(eng, n, vocab, args.repeats))
        prefill[n] = max(runs)
    bar.update()
    # Batch 1 against the bandwidth limit: the read bandwidth of this shared machine moved by
    # up to 1.5x within a minute here, so each decode run is paired with a reading taken just
    # before it, and the ratio is the median of the pairs.
    # The reading runs in a process of its own: torch ops on this thread beside the engine
    # would start a second OpenMP pool and slow the engine's (engine.cpu_runtime; measured
    # here: 21 against 35 tok/s, and still ~30 after releasing that pool).
    pairs = []
    for s in range(3):
        bw_now = fresh(BANDWIDTH_SCRIPT, folder, args.threads, dtype)["read_bytes_s"]
        pairs.append((engine_decode(eng, 1, vocab, args.b1_steps, s), bw_now))
    decode = {1: max(tok_s for tok_s, _ in pairs)}
    b1_of_limit = statistics.median(tok_s * read_bytes / bw_now for tok_s, bw_now in pairs)
    b1_bw = statistics.median(bw_now for _, bw_now in pairs)
    bar.update()
    for batch in (16, 64):
        decode[batch] = max(
            engine_decode(eng, batch, vocab, args.decode_steps, s) for s in range(2)
        )
        bar.update()
    eng.shutdown()
    del eng  # (its weights: a 14 GB model loaded twice at once exceeded 24 GB here)
    gc.collect()
    prompts = w1_workload(vocab)
    eng = Engine(model_path=str(folder), num_threads=args.threads, dtype=dtype)
    ideal = 4 * 576 + 28 * (576 - 512)  # each group's first computes all, the rest the question
    t, computed = engine_w1(eng, prompts)
    eng.shutdown()
    del eng
    gc.collect()
    nan = float("nan")
    hf_prefill_s, hf_decode_s, hf_w1_s = dict.fromkeys(prefill, nan), {}, nan
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
        hf_prefill_s = {n: hf_prefill(hf, n, vocab) for n in prefill}
        hf_decode_s = {b: hf_decode(hf, b, vocab, args.decode_steps) for b in (1, 16)}
        hf_w1_s = hf_w1(hf, prompts)
        del hf
    # a prefill token's matmuls: every linear layer but the LM head, which runs for a request's
    # last token only (attention's own products left out: the limit stays an upper bound)
    prefill_limit = max(prefill_flops) / (2 * (linear_params - head_params))
    for n, ours in prefill.items():
        theirs = hf_prefill_s[n]
        line(preset, f"prefill_{n}", tok_s=ours, hf_tok_s=theirs, ratio_to_hf=ours / theirs,
             limit_tok_s=prefill_limit, of_limit=ours / prefill_limit)  # fmt: skip
    decode_limit = b1_bw / read_bytes
    for batch, ours in decode.items():
        theirs = hf_decode_s.get(batch, nan)
        extra = dict(limit_tok_s=decode_limit, of_limit=b1_of_limit) if batch == 1 else {}
        line(preset, f"decode_b{batch}", tok_s=ours, hf_tok_s=theirs, ratio_to_hf=ours / theirs,
             over_batch1=ours / decode[1], **extra)  # fmt: skip
    line(preset, "w1", seconds=t, computed_prompt_tokens=computed, ideal_tokens=ideal,
         hf_seconds=hf_w1_s, speedup_vs_hf=hf_w1_s / t)  # fmt: skip
    bar.update()
    bar.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--presets", nargs="*", default=list(PRESETS), choices=[*PRESETS, *MORE_PRESETS]
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--starts", type=int, default=3, help="fresh processes for start figures")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=16, help="batches 16 and 64, transformers'")
    ap.add_argument("--b1-steps", type=int, default=64, help="the engine's batch-1 decode runs")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers comparison")
    ap.add_argument(
        "--dtype",
        default="",
        choices=["", "bfloat16", "float32"],
        help="compute dtype of both engines (default: bfloat16 where this CPU has bf16 "
        "matmuls in hardware, else float32: see kernels/cpu_features.py)",
    )
    ap.add_argument("--disable-tqdm", action="store_true")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from mambaradix.models.transformers_torch_path import use_torch_path

    use_torch_path()  # transformers as users run it on a CPU, fla-core installed or not
    from mambaradix.kernels.cpu_features import fast_bf16_matmul

    args.dtype = args.dtype or ("bfloat16" if fast_bf16_matmul() else "float32")
    dt = getattr(torch, args.dtype)
    bw, flops = read_bandwidth(args.threads), matmul_flops(args.threads, dt)
    print(
        f"# bench_real threads={args.threads} torch={torch.__version__} dtype={args.dtype} "
        f"read_GB_s={bw / 1e9:.1f} matmul_GFLOP_s={flops / 1e9:.0f}",
        flush=True,
    )
    for preset in args.presets:
        run_preset(preset, args)


if __name__ == "__main__":
    main()
