"""GPU benchmark of the ``cuda`` backend (run by ``bench/gpu_check.sh`` on a GPU machine).

Per preset (random weights of the published configuration in bf16, drawn on the GPU and saved
once): the engine's start, prefill tok/s of one 2k- and one 8k-token prompt (cache off), decode
tok/s at batch 1 / 16 / 64 / 256 with CUDA graphs on and off, and the W1 workload scaled up
(``--w1-groups`` groups x 16 requests of a 2k-token system prompt + a 64-token question, 16 new
tokens, all sent at once, cache on); each against ``transformers`` on the same GPU (its load,
prefill, cached decode at batch 1 and 16, and W1 ``generate`` in batches of 16 over the first
``--hf-w1-groups`` groups, its time scaled to all of them and labelled so) and against the
limits measured in the same run: HBM read bandwidth (bytes of a decode step's weights / read
rate) and the bf16 matmul rate (2 x linear parameters per token). Also the host-device syncs
of a decode step (``torch.cuda.set_sync_debug_mode``). The presets run in the order given (the
9B shape first by default). Each figure is written as measured, one JSON object per line to
``--out`` and a line to stdout; the last records judge issue 31's goals (``GOALS``).

After the presets, in the last ``--kernels-s`` of ``--budget-s`` (the presets start no new part
in them): the kernels' own comparisons (the two Mamba2 prefill forms, the prefill attention's
tile sets against SDPA, the routed experts' grouped GEMM against the reference at the MoE
models' shapes, none of which the presets measure); ``--presets`` with no names runs only
those.

    python bench/bench_gpu.py --out /tmp/gpu.jsonl --presets qwen3_5_0_8b granite_4_0_h_350m

``--dry-run`` runs every part of it on this machine's CPU at toy sizes (presets cut to a few
layers and a small vocabulary, short prompts, small batches, small kernel shapes; the engine on
its CPU backend, the kernels' comparisons under Triton's interpreter with the tests' shim): its
figures mean nothing; it checks that the script runs before a GPU's minutes are spent on it
(tests/bench/test_bench_gpu.py).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time
import warnings
from importlib.util import find_spec
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_real import (  # noqa: E402
    engine_decode,
    large_tokenizer,
    published_tokenizer_config,
    weight_figures,
)

TOKENIZER_CLASS = {
    "qwen3_5_0_8b": "Qwen2Tokenizer",
    "qwen3_5_9b": "Qwen2Tokenizer",
    "granite_4_0_h_350m": "GPT2Tokenizer",
    "lfm2_350m": "TokenizersBackend",
}
RECORDS: list[dict] = []
DEV = "cuda"  # "cpu" under --dry-run


def record(out: Path, preset: str, what: str, **fields) -> None:
    rec = {"preset": preset, "what": what, **fields}
    RECORDS.append(rec)
    with open(out, "a") as fh:
        fh.write(json.dumps(rec) + "\n")
    body = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in fields.items())  # fmt: skip
    print(f"{preset:<20} {what:<14} {body}", flush=True)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- limits


def hbm_read_bandwidth(numel: int = 1 << 31) -> float:
    """Bytes/s of a sum over ``numel`` bf16 values (4 GiB: a read-only stream), best of 10."""
    x = torch.ones(numel, dtype=torch.bfloat16, device=DEV)
    x.sum()
    best = min(timed(x.sum) for _ in range(10))
    del x
    return numel * 2 / best


def bf16_matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = min(timed(lambda: a @ b) for _ in range(10))
    return 2 * n**3 / best


# --------------------------------------------------------------------------- kernels


def multiprocessors() -> int:
    """The GPU's multiprocessors (an H100 SXM's 132 in a dry run, which has none)."""
    if DEV != "cuda":
        return 132
    return torch.cuda.get_device_properties("cuda").multi_processor_count


MAMBA2_SHAPES = {"granite_4_0_h_350m": (24, 64, 1, 128), "nemotron_h_8b": (128, 64, 8, 128)}


def mamba2_prefill_forms(out: Path, shapes: dict = MAMBA2_SHAPES, long: int = 8192) -> None:
    """The cuda backend's two Mamba2 prefills (the sequential kernel and the fully parallel
    one) at real head shapes, bf16 inputs, fp32 pool: one 8k-token segment and 16 of 512; ms
    each (best of 5), and the form ``prefers_chunked`` picks, to check and tune that rule."""
    from mambaradix.kernels.triton import mamba2_chunked as m2c

    sms = multiprocessors()
    for name, shape in shapes.items():
        for lens in ([long], [long // 16] * 16):
            ms, num_chunks = _mamba2_forms_ms(shape, lens)
            picks = m2c.prefers_chunked(len(lens), num_chunks, *shape[:2], shape[3], sms)
            record(out, name, f"mamba2_{len(lens)}x{lens[0]}", sequential_ms=ms["sequential"],
                   chunked_ms=ms["chunked"],
                   picks="chunked" if picks else "sequential")  # fmt: skip


ATTENTION_TILES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)]


def attention_prefill_tiles(
    out: Path, heads: tuple = ((8, 2, 128), (16, 4, 256)), segs: int = 4, n: int = 2048
) -> None:
    """The prefill attention kernel under each tile set (``ATTENTION_TILES``: rows, keys,
    warps, stages) and its default, 4 causal segments of 2,048 tokens, bf16, at 128-wide heads
    with GQA 4 (Nemotron-H's) and Qwen3.5-9B's 16 x 4 x 256: ms (best of 5) and torch's SDPA
    on the same causal problem over its ms. ``ptxas`` reports spills for the default 4-warp
    128 x 64 tiles at 128-wide heads and none with 8 warps (tests/triton/compile_for_gpu.py):
    this run decides which is faster."""
    for hq, hkv, d in heads:
        sdpa_ms, ms = _attention_tiles_ms(hq, hkv, d, segs, n)
        record(out, f"attn_{hq}x{hkv}x{d}", "prefill_tiles", sdpa_ms=sdpa_ms,
               **{f"ms_{k}": v for k, v in ms.items()},
               **{f"sdpa_over_{k}": sdpa_ms / v for k, v in ms.items()})  # fmt: skip


def _attention_tiles_ms(
    hq: int, hkv: int, d: int, segs: int = 4, n: int = 2048
) -> tuple[float, dict]:
    from mambaradix.kernels.triton import attention

    dev = DEV
    T = segs * n
    q = torch.randn(T, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, hkv, d, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, n, device=dev, dtype=torch.int32)
    prefix = torch.zeros(segs, device=dev, dtype=torch.int32)
    table = torch.arange(T, device=dev, dtype=torch.int32).view(segs, n)
    ms = {}
    for tiles in [None, *ATTENTION_TILES]:
        spec = None if tiles is None else attention.AttentionTiles(*tiles)

        def fn(spec=spec):
            attention.paged_attention_prefill(q, k, k, cu, prefix, table, d**-0.5, n, tiles=spec)

        fn()  # compiles
        ms["default" if tiles is None else "x".join(map(str, tiles))] = (
            min(timed(fn) for _ in range(5)) * 1e3
        )
    qs = q.view(segs, n, hq, d).transpose(1, 2)
    ks = k.view(segs, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)

    def sdpa():
        torch.nn.functional.scaled_dot_product_attention(qs, ks, ks, is_causal=True)

    sdpa()
    return min(timed(sdpa) for _ in range(5)) * 1e3, ms


def _mamba2_forms_ms(shape: tuple[int, int, int, int], lens: list[int]) -> tuple[dict, int]:
    from mambaradix.kernels.triton import gdn
    from mambaradix.kernels.triton import mamba2 as m2
    from mambaradix.kernels.triton import mamba2_chunked as m2c

    dev = DEV
    H, P, G, N = shape
    T, segs = sum(lens), len(lens)
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    x, B, C = (torch.randn(T, *dims, **bf16) for dims in ((H, P), (G, N), (G, N)))
    dt = torch.rand(T, H, device=dev) * 0.1
    A, D = -torch.rand(H, device=dev) - 0.1, torch.randn(H, device=dev)
    pool = torch.zeros(segs, H, P, N, device=dev)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    slots = torch.arange(segs, device=dev, dtype=torch.int32)
    none = torch.empty(0, device=dev, dtype=torch.int32)
    chunks = gdn.GdnChunks.build(lens, dev)
    args = (x, dt, A, B, C, D, pool, cu, slots)
    forms = {
        "sequential": lambda: m2.mamba2_prefill(*args, none, none, none),
        "chunked": lambda: m2c.mamba2_prefill_chunked(*args, none, none, chunks.indices,
                                                      chunks.offsets),
    }  # fmt: skip
    ms = {}
    for form, fn in forms.items():
        fn()  # compiles
        ms[form] = min(timed(fn) for _ in range(5)) * 1e3
    return ms, chunks.indices.shape[0]


# experts, top k, intermediate, hidden, gated (models/published_configs.py): Qwen3-Next's many
# small experts and Nemotron-3-Nano's few wide plain ones
MOE_SHAPES = {
    "qwen3_next_80b_a3b": (512, 10, 512, 2048, True),
    "nemotron_3_nano_30b_a3b": (128, 6, 1856, 2688, False),
}


def moe_experts_kernel(
    out: Path, shapes: dict = MOE_SHAPES, batches: tuple = (1, 16, 64, 256, 2048),
    hbm_bytes_s: float | None = None,
) -> None:  # fmt: skip
    """One MoE layer's routed part at published shapes, bf16, random routing (each token's k
    experts drawn without repeats): the cuda backend's Triton grouped GEMM (``triton/moe.py``)
    against the torch reference (a padded bmm over every expert up to 64 pairs an expert, a
    per-expert loop beyond), ms (best of 5), and the grouped GEMM's read of the routed experts'
    weights over the HBM read rate measured in this run (the decode batches' limit)."""
    from mambaradix.kernels import moe as reference
    from mambaradix.kernels.activation import activation
    from mambaradix.kernels.torch_backend import TorchBackend
    from mambaradix.kernels.triton import moe as triton_moe

    g = torch.Generator(device=DEV).manual_seed(0)
    bf16 = dict(device=DEV, dtype=torch.bfloat16)
    for name, (E, K, inter, hidden, gated) in shapes.items():
        act = activation("silu" if gated else "relu2")
        rows = (2 if gated else 1) * inter
        up = torch.randn(E, rows, hidden, generator=g, **bf16) * 0.02
        down = torch.randn(E, hidden, inter, generator=g, **bf16) * 0.02
        for T in batches:
            x = torch.randn(T, hidden, generator=g, **bf16)
            ids = torch.rand(T, E, generator=g, device=DEV).argsort(-1)[:, :K]
            w = torch.softmax(torch.randn(T, K, generator=g, device=DEV), -1)
            args = (x, w, ids, up, down, act)
            sides = {
                "triton": functools.partial(triton_moe.moe_experts, *args, gated),
                "reference": functools.partial(
                    reference.moe_experts, TorchBackend(), *args, 0, gated
                ),
            }
            ms = {}
            for side, fn in sides.items():
                fn()  # compiles
                ms[side] = min(timed(fn) for _ in range(5)) * 1e3
            del args, sides
            routed = ids.unique().numel() * (rows + inter) * hidden * 2
            extra = {}
            if hbm_bytes_s:
                extra["of_hbm_limit"] = routed / hbm_bytes_s / (ms["triton"] / 1e3)
            record(out, name, f"moe_b{T}", triton_ms=ms["triton"], reference_ms=ms["reference"],
                   reference_over_triton=ms["reference"] / ms["triton"], **extra)  # fmt: skip
        del up, down
        empty_cache()


# --------------------------------------------------------------------------- checkpoints


@functools.lru_cache(maxsize=2)
def _tokenizer(vocab_size: int):
    """``large_tokenizer``, built once per vocabulary (both Qwen3.5 presets have 248,320)."""
    return large_tokenizer(vocab_size)


def checkpoint(preset: str, root: Path, **cuts: int | None) -> Path:
    """The preset's bf16 checkpoint under ``root`` (built once, its weights drawn on the
    device; ``cuts``: ``layers`` / ``vocab`` for a dry run)."""
    from mambaradix.models.published import build_published

    folder = root / "-".join([preset, *(f"{k}{v}" for k, v in cuts.items() if v)])
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    build_published(preset, tmp, device=DEV, **cuts)
    config = json.loads((tmp / "config.json").read_text())
    tok = _tokenizer(config["vocab_size"])
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    config.update(eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(tmp)
    import bench_real

    bench_real.TOKENIZER_CLASS.setdefault(preset, TOKENIZER_CLASS[preset])
    published_tokenizer_config(tmp, preset)
    tmp.rename(folder)
    empty_cache()
    return folder


# --------------------------------------------------------------------------- engine


def engine_prefill(eng, n: int, vocab: int) -> float:
    p = {"temperature": 0, "max_new_tokens": 1}
    ids = lambda k: [(i * 7919 + k * 104729) % (vocab - 10) + 5 for i in range(n)]  # noqa: E731
    eng.generate(input_ids=ids(0), sampling_params=p)
    return n / min(timed(lambda k=k: eng.generate(input_ids=ids(k), sampling_params=p))
                   for k in (1, 2))  # fmt: skip


def decode_syncs(eng, vocab: int, steps: int = 8) -> float:
    """Host-device syncs torch reports per decode step at batch 1 (the sampled token ids'
    read is one)."""
    from mambaradix.core import SamplingParams

    p = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    eng.generate(input_ids=[list(range(5, 133))], sampling_params=p)  # shapes seen
    p = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
    handle = eng.submit_many([list(range(7, 135))], [p])[0]
    seen = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = True
        for out in handle.events():
            if first and out.new_token_ids:  # prefill done: count the decode steps only
                sync_debug("warn")
                first = False
                continue
            seen += len(out.new_token_ids)
        sync_debug(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs / max(seen, 1)


def sync_debug(mode: str | int) -> None:
    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode(mode)


def engine_w1(eng, prompts: list[list[int]]) -> tuple[float, int]:
    before = eng.stats().computed_prefill_tokens
    p = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    t = timed(lambda: eng.generate(input_ids=prompts, sampling_params=[p] * len(prompts)))
    return t, eng.stats().computed_prefill_tokens - before


def w1_prompts(vocab: int, groups: int, system: int) -> list[list[int]]:
    import random

    rng = random.Random(1)
    tok = lambda k: [rng.randrange(5, vocab - 5) for _ in range(k)]  # noqa: E731
    systems = [tok(system) for _ in range(groups)]
    return [systems[g] + tok(64) for g in range(groups) for _ in range(16)]


# --------------------------------------------------------------------------- transformers


def hf_load_model(folder: Path) -> tuple[torch.nn.Module, str]:
    """transformers' model of ``folder`` on the device, and how it got there: straight onto it
    (``device_map``, which needs ``accelerate``) or, without ``accelerate``, loaded into host
    memory and moved (slower: the start comparison names which)."""
    from transformers import AutoModelForCausalLM

    kw = dict(dtype=torch.bfloat16)
    if find_spec("accelerate") is not None:
        hf, path = (
            AutoModelForCausalLM.from_pretrained(str(folder), device_map=DEV, **kw),
            "device_map",
        )
    else:
        hf, path = (
            AutoModelForCausalLM.from_pretrained(str(folder), **kw).to(DEV),
            "host_then_moved",
        )
    sync()
    return hf.eval(), path


def hf_prefill(hf, n: int, vocab: int) -> float:
    ids = torch.tensor([[(i * 7919) % (vocab - 10) + 5 for i in range(n)]], device=DEV)
    with torch.inference_mode():
        hf(input_ids=ids, logits_to_keep=1)
        return n / min(timed(lambda: hf(input_ids=ids, logits_to_keep=1)) for _ in range(2))


def hf_decode(hf, batch: int, vocab: int, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(5, vocab - 5, (batch, 128), device=DEV)
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        pos = torch.arange(128, device=DEV)[None].expand(batch, -1)
        hf(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
           logits_to_keep=1)  # fmt: skip
        tok = torch.ones(batch, 1, dtype=torch.long, device=DEV)

        def run() -> None:
            for s in range(steps):
                pos = torch.full((batch, 1), 128 + s, device=DEV)
                hf(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)

        return batch * steps / timed(run)


def hf_w1(hf, prompts: list[list[int]]) -> float:
    def run() -> None:
        with torch.inference_mode():
            for i in range(0, len(prompts), 16):
                batch = torch.tensor(prompts[i : i + 16], device=DEV)
                hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=16,
                            min_new_tokens=16, do_sample=False)  # fmt: skip

    return timed(run)


# --------------------------------------------------------------------------- main


def run_preset(preset: str, args, out: Path, limits: dict, deadline: float) -> None:
    """The preset's figures, each written as soon as it is measured (a run its timeout cuts
    short keeps what it had), then transformers' on the same checkpoint, in records of their
    own with the ratio to ours. Eager decode is the same engine with its captured steps put
    aside (``runner.graphs``), which saves a second load of the weights (18 GB at 9B)."""
    from mambaradix.engine.engine import Engine

    def time_left() -> bool:
        return time.perf_counter() < deadline

    t0 = time.perf_counter()
    folder = checkpoint(preset, Path(args.root), layers=args.layers, vocab=args.vocab)
    record(out, preset, "checkpoint", seconds=time.perf_counter() - t0)
    kw = dict(device=DEV, dtype="bfloat16", disable_radix_cache=True,
              mem_fraction_static=args.mem_fraction, mem_budget_gb=args.mem_budget_gb)  # fmt: skip
    t0 = time.perf_counter()
    eng = Engine(model_path=str(folder), **kw)
    ours = {"start": time.perf_counter() - t0}
    read_bytes, linear_params, head_params = weight_figures(eng.model)
    vocab = eng.model.vocab_size
    record(out, preset, "start", seconds=ours["start"], weight_gb=read_bytes / 1e9,
           backend=eng.kernel_backend, chunk=eng.config.chunked_prefill_size,
           forward_tokens=eng.config.max_prefill_tokens)  # fmt: skip
    # a prefill token's linear FLOPs at the bf16 rate (the LM head: last tokens only); a
    # decode step's bytes at the read bandwidth
    prefill_limit = limits["bf16_flops"] / (2 * (linear_params - head_params))
    decode_limit = limits["hbm_read_bytes_s"] / read_bytes
    for n in args.prefill_lens:
        ours[f"prefill_{n}"] = tok_s = engine_prefill(eng, n, vocab)
        record(out, preset, f"prefill_{n}", tok_s=tok_s, of_bf16_limit=tok_s / prefill_limit)
    for b in args.batches:
        if not time_left():
            break
        ours[f"decode_b{b}"] = tok_s = engine_decode(eng, b, vocab, args.steps, 0)
        extra = {"of_hbm_limit": tok_s / decode_limit} if b == 1 else {}
        record(out, preset, f"decode_b{b}", tok_s=tok_s, **extra)
    record(out, preset, "decode_syncs", per_step=decode_syncs(eng, vocab))
    graphs, eng.runner.graphs = eng.runner.graphs, None
    for b in args.batches:
        if not time_left() or f"decode_b{b}" not in ours:
            break
        tok_s = engine_decode(eng, b, vocab, args.steps, 0)
        record(out, preset, f"decode_eager_b{b}", tok_s=tok_s,
               graphs_over_eager=ours[f"decode_b{b}"] / tok_s)  # fmt: skip
    eng.runner.graphs = graphs
    eng.shutdown()
    del eng, graphs
    empty_cache()
    prompts = w1_prompts(vocab, args.w1_groups, args.w1_system)
    if time_left():
        eng = Engine(model_path=str(folder), **dict(kw, disable_radix_cache=False))
        t, computed = engine_w1(eng, prompts)
        ours["w1"] = t
        groups = args.w1_groups
        ideal = groups * (args.w1_system + 64) + groups * 15 * 64
        record(out, preset, "w1", seconds=t, computed_prompt_tokens=computed,
               ideal_tokens=ideal)  # fmt: skip
        eng.shutdown()
        del eng
        empty_cache()
    if not args.skip_hf and time_left():
        hf_figures(preset, folder, args, out, ours, prompts, vocab, time_left)


def hf_figures(preset: str, folder: Path, args, out: Path, ours: dict, prompts, vocab: int,
               time_left) -> None:  # fmt: skip
    """transformers on the same checkpoint and GPU: its load, prefill, cached decode at batch
    1 and 16, and W1 ``generate`` over the first ``--hf-w1-groups`` groups, its time scaled to
    all of them; each record has ours over it (W1: its time over ours)."""
    t0 = time.perf_counter()
    hf, path = hf_load_model(folder)
    load = time.perf_counter() - t0
    # the kernel packages transformers' hybrid models take when installed (without them, its
    # Mamba2 / conv layers run their PyTorch reference: its figures say so)
    kernels = [m for m in ("fla", "mamba_ssm", "causal_conv1d") if find_spec(m) is not None]
    record(out, preset, "hf_load", seconds=load, path=path, kernels="+".join(kernels) or "none",
           ours_start_over_it=ours["start"] / load)  # fmt: skip
    for n in args.prefill_lens:
        try:
            tok_s = hf_prefill(hf, n, vocab)
        except Exception as e:  # (out of memory at 8k, say): reported, not fatal
            record(out, preset, f"hf_prefill_{n}_error", error=repr(e)[:200])
            continue
        record(out, preset, f"hf_prefill_{n}", tok_s=tok_s,
               ours_over_it=ours[f"prefill_{n}"] / tok_s)  # fmt: skip
    for b in (1, 16):
        if f"decode_b{b}" in ours and time_left():
            tok_s = hf_decode(hf, b, vocab, args.steps)
            record(out, preset, f"hf_decode_b{b}", tok_s=tok_s,
                   ours_over_it=ours[f"decode_b{b}"] / tok_s)  # fmt: skip
    if "w1" in ours and time_left():
        sub = prompts[: 16 * args.hf_w1_groups]
        scaled = hf_w1(hf, sub) * len(prompts) / len(sub)
        record(out, preset, "hf_w1", seconds_scaled=scaled, groups_run=args.hf_w1_groups,
               ours_speedup=scaled / ours["w1"])  # fmt: skip
    del hf
    empty_cache()


# --dry-run's toy sizes: every part runs on the CPU in well under a minute
DRY_RUN = dict(presets=["qwen3_5_0_8b", "granite_4_0_h_350m"], layers=4, vocab=2048,
               prefill_lens=[64, 160], batches=[1, 3], steps=3, w1_groups=2, w1_system=128,
               hf_w1_groups=1, mem_budget_gb=0.5)  # fmt: skip
DRY_KERNELS = dict(mamba2=({"toy": (2, 16, 1, 16)}, 128), attention=(((2, 1, 32),), 2, 64),
                   moe=({"toy_gated": (8, 2, 16, 32, True), "toy_plain": (8, 2, 16, 32, False)},
                        (1, 40)))  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # the 9B shape first: two of the goals (decode batch 1 against HBM, prefill at 8k against
    # the bf16 rate) are its figures, and the budget may not reach the last preset
    ap.add_argument("--presets", nargs="*",
                    default=["qwen3_5_9b", "qwen3_5_0_8b", "granite_4_0_h_350m"])  # fmt: skip
    ap.add_argument("--out", default="gpu.jsonl")
    ap.add_argument("--root", default="/tmp/mambaradix-gpu")
    ap.add_argument("--prefill-lens", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--w1-groups", type=int, default=64)
    ap.add_argument("--w1-system", type=int, default=2048)
    ap.add_argument("--hf-w1-groups", type=int, default=4)
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--mem-budget-gb", type=float, default=0.0, help="pools' budget (0: fraction)")
    ap.add_argument("--layers", type=int, default=None, help="cut the presets to this many layers")
    ap.add_argument("--vocab", type=int, default=None, help="cut the presets' vocabulary")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--budget-s", type=float, default=360.0, help="stop starting new parts after")
    ap.add_argument("--kernels-s", type=float, default=60.0,
                    help="of the budget, kept for the kernels' comparisons")  # fmt: skip
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="every part on the CPU at toy sizes: checks the script, not the GPU",
    )
    return ap


def _interpret_triton_kernels() -> None:
    """A dry run without a GPU runs the kernels' comparisons under Triton's interpreter, with the
    tests' shim (tests/triton/interpreter.py: bf16 on values, no autotuning), installed before
    any kernel module is imported (a no-op where it already is or where a GPU exists)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "triton"))
    import interpreter

    if "mambaradix.kernels.triton" in sys.modules and not interpreter._INSTALLED:
        raise RuntimeError("--dry-run: the Triton kernels were imported before the interpreter")
    interpreter.install()


def main(argv: list[str] | None = None) -> None:
    global DEV
    ap = parser()
    args = ap.parse_args(argv)
    if args.dry_run:
        DEV = "cpu"
        _interpret_triton_kernels()
        from mambaradix.models.transformers_torch_path import use_torch_path

        use_torch_path()  # transformers' layers on their torch path (fla's need a GPU)
        for k, v in DRY_RUN.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    end = time.perf_counter() + args.budget_s
    deadline = end - args.kernels_s  # the presets'
    if DEV == "cuda":
        limits = {"hbm_read_bytes_s": hbm_read_bandwidth(), "bf16_flops": bf16_matmul_rate()}
        name = torch.cuda.get_device_name()
    else:
        limits = {
            "hbm_read_bytes_s": hbm_read_bandwidth(1 << 24),
            "bf16_flops": bf16_matmul_rate(512),
        }
        name = "cpu (dry run)"
    record(out, "machine", "limits", gpu=name, **limits)
    for preset in args.presets:
        if time.perf_counter() > deadline:
            record(out, preset, "skipped", reason="time budget")
            continue
        try:
            run_preset(preset, args, out, limits, deadline)
        except Exception as e:  # one preset's failure is reported, the others still run
            import traceback

            traceback.print_exc()
            record(out, preset, "error", error=repr(e)[:500])
    # the kernels' own comparisons, after the presets' figures, in the time left
    hbm = (limits["hbm_read_bytes_s"],)
    parts = [(mamba2_prefill_forms, ()), (attention_prefill_tiles, ()),
             (moe_experts_kernel, (MOE_SHAPES, (1, 16, 64, 256, 2048), *hbm))]  # fmt: skip
    if args.dry_run:
        parts = [(mamba2_prefill_forms, DRY_KERNELS["mamba2"]),
                 (attention_prefill_tiles, DRY_KERNELS["attention"]),
                 (moe_experts_kernel, (*DRY_KERNELS["moe"], *hbm))]  # fmt: skip
    for part, sizes in parts:
        if time.perf_counter() > end:
            record(out, "kernels", "skipped", part=part.__name__, reason="time budget")
            continue
        try:
            part(out, *sizes)
        except Exception as e:  # one part's failure is reported, the other still runs
            import traceback

            traceback.print_exc()
            record(out, "kernels", "error", part=part.__name__, error=repr(e)[:500])
    goals(out, max(args.prefill_lens))
    print("done", flush=True)


# issue 31's goals: (record, field, at least / at most, threshold); the decode at batch 1 is
# the 9B shape's where it ran (else every preset's is shown), the others every preset's
GOALS = [
    ("decode_b1", "of_hbm_limit", ">=", 0.6),
    ("prefill_{long}", "of_bf16_limit", ">=", 0.5),
    ("hf_w1", "ours_speedup", ">=", 5.0),
    ("decode_syncs", "per_step", "<=", 1.0),  # the greedy tokens' one read
]


def goals(out: Path, long: int) -> None:
    """One record per (goal, preset) measured: the figure, the threshold and whether it is met
    (a goal no preset measured is recorded as not measured)."""
    import math

    for what, field, sense, threshold in GOALS:
        what = what.format(long=long)
        found = [r for r in RECORDS if r["what"] == what and field in r]
        if what == "decode_b1":
            found = [r for r in found if r["preset"] == "qwen3_5_9b"] or found
        for r in found:
            v = r[field]
            met = not math.isnan(v) and (v >= threshold if sense == ">=" else v <= threshold)
            record(out, r["preset"], "goal", figure=f"{what}.{field}", value=v,
                   threshold=f"{sense} {threshold}", met=met)  # fmt: skip
        if not found:
            record(out, "-", "goal", figure=f"{what}.{field}", threshold=f"{sense} {threshold}",
                   met="not measured")  # fmt: skip


if __name__ == "__main__":
    main()
