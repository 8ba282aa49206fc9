"""transformers as a reference that shares nothing with the engine: on a Gated DeltaNet and a
Mamba2 hybrid, a shared-prefix workload served with the cache on (hits from resumed snapshots,
in-batch sharing and exact repeats) gives transformers' greedy tokens and their logprobs."""

from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mambaradix.engine.engine import Engine  # noqa: E402
from mambaradix.models.loader import resolve_model_path  # noqa: E402

NEW_TOKENS = 4
LOGPROB_ATOL = 1e-4  # fp32, as the model oracle tests
NEAR_TIE = 1e-4


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs from transformers' own prefill and cached decode steps."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    ids, lps = [], []
    step, start = list(prompt), 0
    with torch.inference_mode():
        for _ in range(n):
            x = torch.tensor([step])
            pos = torch.arange(start, start + len(step))[None]
            logits = hf(input_ids=x, position_ids=pos, cache=cache, use_cache=True).logits
            logits = logits[0, -1].float()
            tok = int(torch.argmax(logits))
            ids.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            start += len(step)
            step = [tok]
    return ids, lps


def workload(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """A burst of prompts over two shared system prompts, then exact repeats and next turns."""
    rng = random.Random(11)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    systems = [tok(70), tok(140)]
    burst = [systems[i % 2] + tok(rng.randrange(5, 30)) for i in range(8)]
    later = [list(burst[0]), list(burst[3]), systems[1] + tok(9), burst[2] + tok(6)]
    return burst, later


@pytest.fixture(scope="module", params=["qwen3_next", "granite_hybrid"])
def reference(request):
    """(arch, burst, later, transformers' greedy outputs of every prompt), once per arch."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model_path(f"tiny:{request.param}")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    burst, later = workload(hf.config.get_text_config().vocab_size)
    return request.param, burst, later, [hf_greedy(hf, p, NEW_TOKENS) for p in burst + later]


@pytest.mark.parametrize("strategy", ["extra_buffer", "no_buffer"])
def test_cache_on_matches_transformers(reference, strategy):
    arch, burst, later, want = reference
    params = dict(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, return_logprob=True)
    with Engine(
        model_path=f"tiny:{arch}",
        debug_integrity=True,
        mamba_scheduler_strategy=strategy,
        page_size=16,
        chunked_prefill_size=64,
        max_total_tokens=8192,
        max_mamba_cache_size=64,
        skip_warmup=True,
    ) as eng:
        got = eng.generate(input_ids=burst, sampling_params=params)
        got += [eng.generate(input_ids=p, sampling_params=params) for p in later]
        eng.check_integrity()
    hits = [g["meta_info"]["cached_tokens"] for g in got]
    assert sum(hits[1:8]) > 0 and min(hits[8:]) > 0, hits  # the cache was really used
    ties = 0
    for n, ((ids, lps), g) in enumerate(zip(want, got)):
        ours = g["meta_info"]["output_token_logprobs"]
        for i, (a, b) in enumerate(zip(ids, g["output_ids"])):
            gap = abs(lps[i] - ours[i])
            if a != b:
                assert gap < NEAR_TIE, f"request {n} token {i}: {a} vs {b}, gap {gap:.2e}"
                ties += 1
                break
            assert gap <= LOGPROB_ATOL, f"request {n} token {i}: logprob off by {gap:.2e}"
    assert ties <= 1
