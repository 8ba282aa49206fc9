"""Speculative decoding in the engine (``--speculative-algorithm NGRAM``): outputs and the
cache's behaviour equal decoding without it.

- Greedy, fp32: the token ids and their logprobs with speculation equal those without, on a
  Gated DeltaNet, a Mamba2 and a short-conv hybrid, cache off and on with both strategies and
  page sizes 1 and 16, with requests that stop on a stop string or token mid-draft; drafts are
  accepted (a workload whose outputs repeat their prompts) and the integrity check runs after
  every step.
- The hits of requests sent one after another are equal (snapshots land where they would).
- Rollback: the working state after a verify step that kept 2 of its 4 tokens equals, bit for
  bit, the state of a forward that only ever saw those 2; negative control: the state after all
  4 (no rollback) differs.
- Sampling with seeds is deterministic with speculation on (the distribution: test_speculative_
  accept.py).
- Flags: what is not supported is refused with the reason.
"""

from __future__ import annotations

import random

import pytest
import torch
from equivalence_helpers import LOGPROB_ATOL, MAX_TIES, compare

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.request_cache import RequestCache
from mambaradix.cache.state_pool import StatePool
from mambaradix.config import EngineConfig
from mambaradix.core import ForwardReq
from mambaradix.engine.engine import Engine
from mambaradix.kernels.backend import create_backend
from mambaradix.layout import ForwardContext, ForwardLayout
from mambaradix.models.loader import load_model, load_tokenizer, resolve_model_path
from mambaradix.stats import EngineStats

CONFIGS = [
    dict(disable_radix_cache=True),
    dict(mamba_scheduler_strategy="no_buffer", page_size=1),
    dict(mamba_scheduler_strategy="extra_buffer", page_size=16),
    dict(mamba_scheduler_strategy="extra_buffer", page_size=1, mamba_track_interval=8),
]
POOLS = dict(max_total_tokens=1 << 14, max_mamba_cache_size=96, disable_overlap_schedule=True)


@pytest.fixture(scope="module", params=["qwen3_next", "granite_hybrid", "lfm2"])
def tiny(request):
    path = resolve_model_path(f"tiny:{request.param}")
    return request.param, load_model(path), load_tokenizer(path)


def _prompts(vocab: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (so n-gram drafts of an output that continues it are
    accepted), some sharing a prefix."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    shared = tok(40)
    out = []
    for i in range(n):
        phrase = tok(rng.randrange(3, 8))
        body = phrase * rng.randrange(2, 6)
        out.append((shared if i % 2 else []) + tok(rng.randrange(1, 10)) + body)
    return out


def _run(model, tok, prompts, flags, params=None, max_new_tokens=20):
    p = dict(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, return_logprob=True)
    params = params or [p] * len(prompts)
    with Engine(model=model, tokenizer=tok, debug_integrity=True, **POOLS, **flags) as eng:
        res = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.is_idle()
        eng.check_integrity()
        return res, eng.stats()


def test_greedy_outputs_equal_decoding_without_speculation(tiny):
    name, model, tok = tiny
    prompts = _prompts(model.vocab_size)
    accepted = 0
    for flags in CONFIGS:
        ref, _ = _run(model, tok, prompts, flags)
        got, stats = _run(model, tok, prompts, dict(flags, speculative_algorithm="NGRAM"))
        ties, worst = compare(ref, got)
        assert ties <= MAX_TIES and worst <= 10 * LOGPROB_ATOL, (name, flags, ties, worst)
        assert stats.spec_verify_ct > 0, flags
        accepted += stats.spec_accepted_tokens - stats.spec_verify_ct  # drafts kept
        metas = [g["meta_info"] for g in got]
        assert any(m.get("spec_verify_ct", 0) > 0 for m in metas)
        for m in metas:
            if m.get("spec_verify_ct"):
                assert 1.0 <= m["spec_accept_length"] <= 4.0
    if name == "lfm2":  # its greedy outputs fall into loops (the others' rarely repeat)
        assert accepted > 0, name  # drafts were kept: verify steps emitted several tokens


def test_stops_mid_draft_equal_decoding_without_speculation(tiny):
    """Stop strings and stop tokens end a request at the same token, the rest of an accepted
    draft dropped."""
    name, model, tok = tiny
    prompts = _prompts(model.vocab_size, n=8, seed=1)
    ref, _ = _run(model, tok, prompts, CONFIGS[2])
    params = []
    for r in ref:  # stop on a token / a piece of text each request does produce
        ids = r["output_ids"]
        p = dict(temperature=0.0, max_new_tokens=20, ignore_eos=True, return_logprob=True)
        if len(params) % 2:
            p["stop_token_ids"] = [ids[len(ids) // 2]]
        else:
            p["stop"] = [r["text"][len(r["text"]) // 2 :][:3]] if r["text"].strip() else []
        params.append(p)
    want, _ = _run(model, tok, prompts, CONFIGS[2], params)
    got, _ = _run(model, tok, prompts, dict(CONFIGS[2], speculative_algorithm="NGRAM"), params)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert any(len(w["output_ids"]) < 20 for w in want)  # the stops did stop requests


@pytest.mark.parametrize(
    "arch",
    ["lfm2", pytest.param("qwen3_next", marks=pytest.mark.slow),
     pytest.param("granite_hybrid", marks=pytest.mark.slow)],
)  # fmt: skip
def test_hits_of_sequential_requests_equal(arch):
    """(One architecture by default: ~20 s each.)"""
    path = resolve_model_path(f"tiny:{arch}")
    name, model, tok = arch, load_model(path), load_tokenizer(path)
    prompts = _prompts(model.vocab_size, n=8, seed=2)
    prompts += [p + [5, 6, 7] for p in prompts[:4]]  # follow-ups of earlier requests
    p = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    for flags in CONFIGS[1:]:
        hits = []
        for spec in ("", "NGRAM"):
            with Engine(model=model, tokenizer=tok, debug_integrity=True, **POOLS, **flags,
                        speculative_algorithm=spec) as eng:  # fmt: skip
                for prompt in prompts:
                    eng.generate(input_ids=prompt, sampling_params=p)
                hits.append(eng.stats().cached_tokens)
        assert hits[0] == hits[1] > 0, (name, flags, hits)


def test_seeded_sampling_is_deterministic_with_speculation():
    path = resolve_model_path("tiny:qwen3_next")
    model, tok = load_model(path), load_tokenizer(path)
    prompts = _prompts(model.vocab_size, n=6, seed=3)
    params = [dict(temperature=0.8, top_p=0.9, seed=100 + i, max_new_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    runs = []
    for _ in range(2):
        got, stats = _run(model, tok, prompts, dict(speculative_algorithm="NGRAM"), params)
        assert stats.spec_verify_ct > 0
        runs.append([g["output_ids"] for g in got])
    assert runs[0] == runs[1]
    other = [dict(p, seed=p["seed"] + 7) for p in params]
    got, _ = _run(model, tok, prompts, dict(speculative_algorithm="NGRAM"), other)
    assert [g["output_ids"] for g in got] != runs[0]  # the seeds matter


# --------------------------------------------------------------------------- rollback


# dense models: a MoE layer batches each expert's tokens, so the rejected tokens change the
# rows an expert's matmul blocks and the kept tokens' rounding
@pytest.mark.parametrize("arch", ["qwen3_5", "granite_hybrid", "lfm2"])
def test_rollback_leaves_no_trace_of_the_rejected_tokens(arch):
    """Two verify forwards of 4 tokens from the same state, the same first 2 (the last sampled
    token and the kept draft) and different rejected ones, each settled as keeping 2
    (``RequestCache.settle_spec``): their working states are equal bit for bit (fp32), and
    equal to a forward of those 2 tokens alone up to the rounding of a forward of another
    length (its matmuls block differently); negative control: the states after all 4 tokens
    (no rollback) differ."""
    model = load_model(resolve_model_path(f"tiny:{arch}"))
    backend = create_backend("cpu")
    model.use_backend(backend)
    kv = KVPool(model.kv_spec, 512, 1)
    st = StatePool(model.state_spec, 16)
    cache = RequestCache(kv, st, ReqSlots(4, 256), enabled=False, strategy="no_buffer",
                         stats=EngineStats())  # fmt: skip
    tensors = [*st.conv, *(t for t in st.temporal if t is not None)]
    prompt = [random.Random(4).randrange(3, model.vocab_size) for _ in range(30)]
    kv_slots = torch.arange(40)

    def forward(req: ForwardReq) -> None:
        layout = ForwardLayout.build([req])
        backend.prepare(layout)
        with torch.inference_mode():
            model.forward(ForwardContext(layout, kv, st))

    class Rc:  # the request-cache fields settle_spec reads and writes
        def __init__(self, working: int, scratch: list[int]) -> None:
            self.state_slot, self.spec_slots = working, scratch

    start = st.alloc(1)[0]
    forward(ForwardReq(0, prompt, kv_slots[:30], start))
    kept, full = [], []
    for rejected in ([11, 12], [13, 14]):
        working, *scratch = st.alloc(4)
        st.copy([start], [working])
        tokens = [prompt[-1], 7, *rejected]
        snaps = [(n + 1, slot) for n, slot in enumerate(scratch)]
        forward(ForwardReq(30, tokens, kv_slots[:34], working, snaps))
        full.append([t[working].clone() for t in tensors])
        rc = Rc(working, scratch)
        cache.settle_spec(rc, 2)
        assert rc.state_slot == scratch[1] and rc.spec_slots == []
        kept.append([t[rc.state_slot].clone() for t in tensors])
    assert all(torch.equal(a, b) for a, b in zip(*kept))
    assert any(not torch.equal(a, b) for a, b in zip(*full))  # without rollback: a trace
    alone = st.alloc(1)[0]
    st.copy([start], [alone])
    forward(ForwardReq(30, [prompt[-1], 7], kv_slots[:32], alone))
    for a, t in zip(kept[0], tensors):
        torch.testing.assert_close(a, t[alone], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "flags, match",
    [
        (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=4), "only 1"),
        (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=9), "num-steps \\+ 1"),
        (dict(speculative_algorithm="NGRAM", speculative_num_steps=0), ">= 1"),
        (dict(speculative_num_steps=5), "needs --speculative-algorithm"),
    ],
)
def test_unsupported_speculation_flags_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**flags).validate()
