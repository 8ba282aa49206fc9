"""Prompt logprobs and logits processing in the engine (fake model): the same values whatever
the cache, chunking and overlap; a cached prefix never hides prompt logprobs."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import fake_engine, rand_tokens
from fake_model import FakeModel

from mambaradix.core import ForwardReq, SamplingParams
from mambaradix.layout import ForwardContext


def _reference(prompt: list[int]) -> list[float]:
    """Logprob of every prompt token 1.. from one all-logits forward of the fake model."""
    from mambaradix.cache.kv_pool import KVPool
    from mambaradix.cache.state_pool import StatePool

    model = FakeModel()
    kv = KVPool(model.kv_spec, 4096, 1)
    st = StatePool(model.state_spec, 4)
    slots = kv.alloc(len(prompt))
    state = st.alloc(1)
    st.clear(state)
    req = ForwardReq(0, list(prompt), slots, int(state[0]))
    logits = model.forward(ForwardContext.build([req], kv, st), all_logits=True)
    lps = torch.log_softmax(logits.float(), -1)
    return lps[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("chunk", [16, -1])
def test_prompt_logprobs_match_a_full_forward_with_the_prompt_cached(rng, overlap, chunk):
    prompt = rand_tokens(rng, 100)
    want = _reference(prompt)
    with fake_engine(chunked_prefill_size=chunk, disable_overlap_schedule=not overlap) as eng:
        eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, "temperature": 0})
        for start in (1, 40):
            p = SamplingParams(
                max_new_tokens=2, temperature=0, prompt_logprob_start=start, prompt_top_logprobs=2
            )
            outs = list(eng.submit(prompt, p).events())
            first = outs[0]
            assert first.prompt_logprobs == pytest.approx(want[start - 1 :], abs=1e-5)
            assert len(first.prompt_top_logprobs) == len(prompt) - start
            assert all(o.prompt_logprobs is None for o in outs[1:])
            # the cache served what precedes the first needed position, nothing after it
            assert outs[-1].cached_tokens <= start - 1
        eng.check_integrity()


def test_penalties_and_bias_same_with_and_without_overlap(rng):
    prompts = [rand_tokens(rng, 20) for _ in range(6)]
    params = {
        "max_new_tokens": 20, "temperature": 0, "frequency_penalty": 1.5,
        "repetition_penalty": 1.3, "logit_bias": {7: 4.0}, "min_tokens": 20,
    }  # fmt: skip
    results = []
    for overlap in (True, False):
        with fake_engine(disable_overlap_schedule=not overlap, eos=[7]) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=params)
            results.append([o["output_ids"] for o in outs])
            plain = eng.generate(
                input_ids=prompts, sampling_params={"max_new_tokens": 20, "temperature": 0}
            )
    assert results[0] == results[1]
    assert results[0] != [o["output_ids"] for o in plain]  # the processing did something
    assert all(len(ids) == 20 for ids in results[0])  # min_tokens kept EOS (7) away
    assert all(7 not in ids for ids in results[0])


def test_prompt_logprobs_survive_retraction(rng):
    """Under KV pressure requests are retracted and re-admitted: each still reports every
    prompt logprob exactly once, equal to the reference."""
    prompts = [rand_tokens(rng, 100) for _ in range(8)]
    p = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True, prompt_logprob_start=1)
    with fake_engine(max_total_tokens=700, chunked_prefill_size=32) as eng:
        handles = [eng.submit(ids, p) for ids in prompts]
        outs = [list(h.events()) for h in handles]
        assert eng.stats().retractions > 0
        eng.check_integrity()
    for ids, events in zip(prompts, outs):
        got = [e.prompt_logprobs for e in events if e.prompt_logprobs is not None]
        assert len(got) == 1 and got[0] == pytest.approx(_reference(ids), abs=1e-5)
        assert sum(len(e.new_token_ids) for e in events) == 60


def test_the_offline_generate_returns_the_logprobs_it_was_asked_for():
    """``Engine.generate`` reports what ``top_logprobs`` and the prompt logprobs ask for (they
    were accepted and dropped before): the same numbers as the request's events."""
    from mambaradix.core import SamplingParams
    from mambaradix.engine.engine import Engine

    ids = [5, 9, 13, 17, 21, 25, 29, 33]
    p = dict(temperature=0.0, max_new_tokens=3, ignore_eos=True, return_logprob=True,
             top_logprobs=4, prompt_logprob_start=2, prompt_top_logprobs=2)  # fmt: skip
    flags = dict(disable_radix_cache=True, debug_integrity=True)
    with Engine(model_path="tiny:qwen3_next", **flags) as eng:
        meta = eng.generate(input_ids=ids, sampling_params=p)["meta_info"]
        (handle,) = eng.submit_many([ids], [SamplingParams(**p)])
        events = list(handle.events())
    tops = [t for ev in events for t in ev.new_top_logprobs or []]
    assert len(meta["output_top_logprobs"]) == 3
    for got, (t_ids, t_lps) in zip(meta["output_top_logprobs"], tops):
        assert got == [[lp, t] for t, lp in zip(t_ids, t_lps)] and len(got) == 4
        assert got[0][0] >= got[-1][0]
    # each chosen token's logprob is its own (greedy: the best alternative's)
    assert [t[0][0] for t in meta["output_top_logprobs"]] == meta["output_token_logprobs"]
    first = next(ev for ev in events if ev.prompt_logprobs is not None)
    assert meta["input_token_logprobs"] == first.prompt_logprobs
    assert len(meta["input_token_logprobs"]) == len(ids) - 2
    assert len(meta["input_top_logprobs"]) == len(ids) - 2
    assert all(len(t) == 2 for t in meta["input_top_logprobs"] if t is not None)
    plain = dict(p, top_logprobs=0, prompt_logprob_start=-1, prompt_top_logprobs=0)
    with Engine(model_path="tiny:qwen3_next", **flags) as eng:
        meta = eng.generate(input_ids=ids, sampling_params=plain)["meta_info"]
    assert "output_top_logprobs" not in meta and "input_token_logprobs" not in meta
