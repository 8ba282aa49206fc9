"""Model runtime benchmark: prefill and batched-decode tokens/s, ours vs transformers.

Same checkpoint (tiny random, built and cached by ``resolve_model_path``), same thread count,
fp32, CPU. Prefill: one prompt of ``--prefill-len`` tokens from an empty cache. Decode: B
requests with a ``--context-len`` token context, ``--decode-steps`` single-token steps, all B
batched in one forward per step (ours: pooled KV + state slots; transformers: a batch with a
DynamicCache). Output: one fixed-format line per (arch, size, phase).

    python bench/bench_models.py --quick
    python bench/bench_models.py --arch qwen3_next --sizes tiny mid --threads 2
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardReq
from mambaradix.layout import ForwardContext
from mambaradix.models.loader import load_model, resolve_model_path
from mambaradix.models.tiny import tiny_archs


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_ours_prefill(model, n: int, repeats: int) -> float:
    kv = KVPool(model.kv_spec, n)
    st = StatePool(model.state_spec, 1)
    ids = torch.randint(0, model.vocab_size, (n,)).tolist()

    def run():
        st.clear([0])
        ctx = ForwardContext.build([ForwardReq(0, ids, torch.arange(n), 0)], kv, st)
        model(ctx)

    return n / _best(run, repeats)


def bench_hf_prefill(hf, n: int, repeats: int) -> float:
    from transformers import DynamicCache

    ids = torch.randint(0, hf.config.get_text_config().vocab_size, (1, n))
    pos = torch.arange(n)[None]

    def run():
        with torch.no_grad():
            hf(input_ids=ids, position_ids=pos, cache=DynamicCache(config=hf.config),
               use_cache=True, logits_to_keep=1)  # fmt: skip

    return n / _best(run, repeats)


def bench_ours_decode(model, batch: int, ctx_len: int, steps: int, repeats: int) -> float:
    total = ctx_len + steps + 1
    kv = KVPool(model.kv_spec, batch * total)
    st = StatePool(model.state_spec, batch)
    slots = [torch.arange(b * total, (b + 1) * total) for b in range(batch)]
    ids = torch.randint(0, model.vocab_size, (batch, ctx_len)).tolist()
    for b in range(batch):  # fill the context (not timed)
        model(ForwardContext.build([ForwardReq(0, ids[b], slots[b], b)], kv, st))
    tok = [1] * batch

    def run():
        for s in range(steps):
            reqs = [ForwardReq(ctx_len + s, [tok[b]], slots[b], b) for b in range(batch)]
            model(ForwardContext.build(reqs, kv, st))

    return batch * steps / _best(run, repeats)


def bench_hf_decode(hf, batch: int, ctx_len: int, steps: int, repeats: int) -> float:
    from transformers import DynamicCache

    vocab = hf.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, ctx_len))
    state = {}

    def prefill():
        cache = DynamicCache(config=hf.config)
        with torch.no_grad():
            hf(input_ids=ids, position_ids=torch.arange(ctx_len)[None].expand(batch, -1),
               cache=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
        state["cache"] = cache

    def run():
        cache = state["cache"]
        with torch.no_grad():
            for s in range(steps):
                pos = torch.full((batch, 1), ctx_len + s)
                hf(input_ids=torch.ones(batch, 1, dtype=torch.long), position_ids=pos,
                   cache=cache, use_cache=True)  # fmt: skip

    best = float("inf")
    for i in range(repeats + 1):
        prefill()
        t0 = time.perf_counter()
        run()
        if i:  # the first round is a warm-up
            best = min(best, time.perf_counter() - t0)
    return batch * steps / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--arch", nargs="*", help="tiny arch names (default: all registered)")
    ap.add_argument("--sizes", nargs="*", default=["tiny", "mid"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--context-len", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny size, short runs")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.prefill_len, args.decode_steps, args.repeats = ["tiny"], 256, 16, 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from mambaradix.models.transformers_torch_path import use_torch_path

    use_torch_path()  # transformers as users run it on a CPU, fla-core installed or not
    archs = args.arch or tiny_archs()
    print(f"# bench_models threads={args.threads} torch={torch.__version__} dtype=float32")
    for arch in archs:
        for size in args.sizes:
            path = resolve_model_path(f"tiny:{arch}:{size}")
            ours = load_model(path)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            rows = []
            phases = [("prefill", 1)] + [(f"decode_b{b}", b) for b in args.batches]
            for phase, b in phases:
                # Alternate ours / transformers, best of --repeats each: the machine may be shared.
                o = h = 0.0
                for _ in range(args.repeats):
                    if phase == "prefill":
                        o = max(o, bench_ours_prefill(ours, args.prefill_len, 1))
                        h = max(h, bench_hf_prefill(hf, args.prefill_len, 1))
                    else:
                        o = max(
                            o, bench_ours_decode(ours, b, args.context_len, args.decode_steps, 1)
                        )
                        h = max(h, bench_hf_decode(hf, b, args.context_len, args.decode_steps, 1))
                rows.append((phase, b, o, h))
            for phase, _, o, h in rows:
                print(f"arch={arch:<15} size={size:<5} phase={phase:<10} ours_tok_s={o:10.1f} "
                      f"hf_tok_s={h:10.1f} speedup={o / h:6.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
