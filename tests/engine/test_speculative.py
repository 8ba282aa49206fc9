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
- Seeded sampling: the tokens and logprobs with speculation equal those without (each emitted
  token drawn from its row as decoding draws it; the distribution: test_speculative_accept.py).
- ``--speculative-disable-by-batch-size``: steps of more decodes verify nothing, outputs equal.
- ``--speculative-adaptive``: fed the step times of a machine where drafts are free it keeps
  drafting, of one where they cannot pay it stops; outputs equal either way.
- Flags: what is not supported is refused with the reason.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from equivalence_helpers import LOGPROB_ATOL, MAX_TIES, compare

import mambaradix.engine.runner as runner_module
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.req_slots import ReqSlots
from mambaradix.cache.request_cache import RequestCache
from mambaradix.cache.state_pool import StatePool
from mambaradix.config import EngineConfig
from mambaradix.core import ForwardReq
from mambaradix.engine.engine import Engine
from mambaradix.engine.running import RunningSet
from mambaradix.engine.spec_policy import AdaptiveDrafts
from mambaradix.engine.speculative import accept_sampled
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


def _seeded(n: int, seed: int = 100) -> list[dict]:
    """Seeded sampling, half of it at a low temperature (drafts of a repeating output kept
    there), half where the draws decide."""
    return [dict(temperature=(0.05, 0.8)[i % 2], top_k=6, seed=seed + i, max_new_tokens=16,
                 ignore_eos=True, return_logprob=True) for i in range(n)]  # fmt: skip


def _textbook_rule(draft, target_probs, generator, draft_probs=None):
    """The rejection rule in its textbook form for a point-mass draft: a uniform draw against
    p(x), the residual drawn on a rejection. The same distribution, other draws."""
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(
            torch.tensor(draft), target_probs.shape[1]).double()  # fmt: skip
    return accept_sampled(draft, target_probs, generator, draft_probs)


@pytest.mark.parametrize("arch", ["lfm2", pytest.param("qwen3_next", marks=pytest.mark.slow)])
def test_seeded_sampling_equals_decoding_without_speculation(arch, monkeypatch):
    """A seeded request draws each emitted token from its row as decoding does, so its tokens
    and logprobs with speculation equal those without, fp32, drafts kept and rejected, and
    with an adaptive cap that moves every step.
    Negative controls: the verify rows drawing after the batch's own draw (no rewind of the
    generator), and the textbook form of the rule (a uniform against p(x)): both differ.
    (~10 s for lfm2, ~40 s for qwen3_next: the Gated DeltaNet one slow-marked.)"""
    path = resolve_model_path(f"tiny:{arch}")
    model, tok = load_model(path), load_tokenizer(path)
    prompts = _prompts(model.vocab_size, n=8, seed=3)
    flags = dict(mamba_scheduler_strategy="extra_buffer", page_size=1, mamba_track_interval=8)
    ref, _ = _run(model, tok, prompts, flags, _seeded(len(prompts)))
    spec = dict(flags, speculative_algorithm="NGRAM")
    got, stats = _run(model, tok, prompts, spec, _seeded(len(prompts)))
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
    ties, worst = compare(ref, got)
    assert ties == 0 and worst <= LOGPROB_ATOL, (ties, worst)
    kept = stats.spec_accepted_tokens - stats.spec_verify_ct
    assert kept < stats.spec_verify_ct * 3, (kept, stats.spec_verify_ct)  # drafts rejected
    if arch == "lfm2":  # its outputs repeat (qwen3_next's rarely do)
        assert kept > 0  # and drafts kept
    caps = itertools.cycle([3, 0, 1, 2])  # the adaptive cap moving every step
    with monkeypatch.context() as m:
        m.setattr(AdaptiveDrafts, "choose", lambda policy, reqs, drafts, batch: next(caps))
        varied, _ = _run(
            model, tok, prompts, dict(spec, speculative_adaptive=True), _seeded(len(prompts))
        )
    assert [g["output_ids"] for g in varied] == [r["output_ids"] for r in ref]
    other, _ = _run(model, tok, prompts, spec, _seeded(len(prompts), seed=200))
    assert [g["output_ids"] for g in other] != [r["output_ids"] for r in ref]  # seeds matter
    for mutant in ("no_rewind", "textbook"):
        with monkeypatch.context() as m:
            if mutant == "no_rewind":
                m.setattr(runner_module, "_seeded_states", lambda batch: {})
            else:
                m.setattr(runner_module, "accept_sampled", _textbook_rule)
            bad, _ = _run(model, tok, prompts, spec, _seeded(len(prompts)))
        assert [g["output_ids"] for g in bad] != [r["output_ids"] for r in ref], mutant


def test_a_step_of_more_decodes_than_the_bound_drafts_nothing(monkeypatch):
    """``--speculative-disable-by-batch-size 2``: steps of 3 or 4 decoding requests verify no
    draft, steps of 1 or 2 do (the short requests end first), and the outputs stay those of
    decoding without speculation."""
    path = resolve_model_path("tiny:lfm2")
    model, tok = load_model(path), load_tokenizer(path)
    prompts = _prompts(model.vocab_size, n=4, seed=4)
    params = [dict(temperature=0.0, max_new_tokens=n, ignore_eos=True, return_logprob=True)
              for n in (3, 6, 24, 24)]  # fmt: skip
    steps: list[tuple[int, int]] = []  # (decoding requests, of which verify a draft)
    schedule = RunningSet.schedule

    def counted(running_set, batch, running, budget):
        decoding = sum(r.seq_len - r.fed_len == 1 for r in running)
        left = schedule(running_set, batch, running, budget)
        steps.append((decoding, len(batch.run.drafts)))
        return left

    monkeypatch.setattr(RunningSet, "schedule", counted)
    ref, _ = _run(model, tok, prompts, CONFIGS[0], params)
    steps.clear()
    spec = dict(CONFIGS[0], speculative_algorithm="NGRAM", speculative_disable_by_batch_size=2)
    got, _ = _run(model, tok, prompts, spec, params)
    ties, worst = compare(ref, got)
    assert ties == 0 and worst <= LOGPROB_ATOL, (ties, worst)
    assert any(n > 2 for n, _ in steps) and all(v == 0 for n, v in steps if n > 2), steps
    assert any(v > 0 for n, v in steps if n <= 2), steps


@pytest.mark.parametrize("machine", ["flat", "superlinear"])
def test_the_adaptive_cap_follows_the_step_costs_and_outputs_stay(machine, monkeypatch):
    """``--speculative-adaptive`` fed step times of a machine where drafts are free (every
    step the same time) keeps the full draft but for a few steps that try shapes not yet
    measured; on one where rows cost more than in proportion (no draft can pay) it settles on
    cap 0 after trying the shapes; the outputs are those of
    decoding without speculation either way, and every verify was cut to the cap."""
    path = resolve_model_path("tiny:lfm2")
    model, tok = load_model(path), load_tokenizer(path)
    prompts = _prompts(model.vocab_size, n=6, seed=5)
    run = runner_module.ModelRunner.run

    def timed(runner, batch):  # the step times of the simulated machine
        result = run(runner, batch)
        rows = result.extend_tokens
        result.seconds = 0.05 if machine == "flat" else 0.01 * rows * rows
        return result

    caps: list[int] = []
    choose = AdaptiveDrafts.choose

    def chosen(policy, reqs, drafts, batch):
        caps.append(choose(policy, reqs, drafts, batch))
        return caps[-1]

    steps: list[tuple[int | None, int]] = []  # per step: its cap, the longest draft verified
    schedule = RunningSet.schedule

    def counted(running_set, batch, running, budget):
        n = len(caps)
        left = schedule(running_set, batch, running, budget)
        longest = max(map(len, batch.run.drafts.values()), default=0)
        steps.append((caps[-1] if len(caps) > n else None, longest))
        return left

    monkeypatch.setattr(runner_module.ModelRunner, "run", timed)
    monkeypatch.setattr(AdaptiveDrafts, "choose", chosen)
    monkeypatch.setattr(RunningSet, "schedule", counted)
    flags = dict(CONFIGS[1])
    ref, _ = _run(model, tok, prompts, flags, max_new_tokens=40)
    got, stats = _run(
        model, tok, prompts, dict(flags, speculative_algorithm="NGRAM", speculative_adaptive=True),
        max_new_tokens=40,
    )  # fmt: skip
    ties, worst = compare(ref, got)
    assert ties == 0 and worst <= LOGPROB_ATOL, (ties, worst)
    assert len(caps) > 10 and stats.spec_draft_tokens > 0
    assert all(longest <= (cap or 0) for cap, longest in steps), steps
    if machine == "flat":
        assert caps.count(3) >= 0.75 * len(caps), caps  # the full draft but for a few tries
    else:
        late = caps[len(caps) // 2 :]
        assert late.count(0) >= len(late) - 1, caps  # cap 0, a probe at most


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
        (dict(speculative_adaptive=True), "needs --speculative-algorithm"),
        (dict(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=-1), ">= 0"),
    ],
)
def test_unsupported_speculation_flags_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**flags).validate()
