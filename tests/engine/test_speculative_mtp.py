"""Speculative decoding with the checkpoint's MTP head (``--speculative-algorithm MTP``) in the
engine, on a tiny dense Qwen3.5 with MTP weights in the published layout (fp32).

- Greedy outputs (ids and logprobs) equal those of the same checkpoint loaded without its head
  and decoding without speculation, cache off and on, both strategies, pages 1 and 16, chunked
  prefill; the integrity check runs after every step.
- Every draft equals a fresh computation: the target's prefill of the request's tokens in new
  pools, the head's rows of that whole sequence (``model.draft``, which ``tests/models/
  test_mtp.py`` checks against a float64 reference), then the chained steps. So the head's K/V
  and hidden state the engine kept over cached prefixes, chunks, decode steps (replayed ones
  included) and verify steps (accepted and rejected tokens) are those of the sequence itself.
  Negative control: a head whose snapshots lack the hidden state (a planted bug) drafts
  differently after cache hits.
- Hits equal those without speculation; draft steps run no deferred state operation and write
  nothing into the state pool; seeded sampling gives the tokens decoding without speculation
  gives, with the cache on or off.
- A checkpoint without ``mtp.*`` weights or an architecture without an MTP head is refused at
  start with the fix.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from equivalence_helpers import LOGPROB_ATOL, MAX_TIES, NEAR_TIE, compare

import mambaradix.models.mtp as mtp_module
from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardReq
from mambaradix.engine.engine import Engine
from mambaradix.engine.mtp_draft import DraftHead, _DraftStep
from mambaradix.engine.runner import ModelRunner
from mambaradix.engine.running import RunningSet
from mambaradix.engine.spec_policy import AdaptiveDrafts
from mambaradix.engine.speculative import Speculation
from mambaradix.kernels.backend import create_backend
from mambaradix.layout import ForwardContext
from mambaradix.models.loader import load_model, load_tokenizer
from mambaradix.models.tiny import make_tiny_checkpoint

CONFIGS = [
    dict(disable_radix_cache=True),
    dict(mamba_scheduler_strategy="no_buffer", page_size=1),
    dict(mamba_scheduler_strategy="extra_buffer", page_size=16, chunked_prefill_size=32),
    dict(mamba_scheduler_strategy="extra_buffer", page_size=1, mamba_track_interval=8),
]
POOLS = dict(max_total_tokens=1 << 14, max_mamba_cache_size=96, disable_overlap_schedule=True)
GREEDY = dict(temperature=0.0, max_new_tokens=16, ignore_eos=True, return_logprob=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_mtp")
    make_tiny_checkpoint("qwen3_5", str(folder), seed=0, mtp=True)
    return folder


@pytest.fixture(scope="module")
def models(ckpt):
    """(the model with its head, the same checkpoint without it, the tokenizer)"""
    path = str(ckpt)
    return load_model(path, mtp=True), load_model(path), load_tokenizer(path)


def _waves(vocab: int, seed: int = 0, shared_len: int = 37) -> list[list[list[int]]]:
    """Two waves: prompts, some sharing a prefix; then follow-ups of the first wave's prompts
    (cache hits on the second wave's requests)."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    shared = tok(shared_len)
    first = [(shared if i % 2 else []) + tok(rng.randrange(3, 50)) for i in range(6)]
    second = [p + tok(rng.randrange(1, 12)) for p in first[:4]]
    return [first, second]


class Recorder:
    """Every draft the scheduler asked for: ``(the request's tokens up to the one the verify
    feeds first, the draft list)``; the runner fills the list in place."""

    def __init__(self, monkeypatch) -> None:
        self.drafts: list[tuple[list[int], list[int]]] = []
        original = Speculation.draft

        def draft(spec, req):
            out = original(spec, req)
            if out:
                self.drafts.append((req.token_slice(0, req.fed_len + 1), out))
            return out

        monkeypatch.setattr(Speculation, "draft", draft)


def _run(model, tok, waves, flags, params=GREEDY):
    outs = []
    with Engine(model=model, tokenizer=tok, debug_integrity=True, **POOLS, **flags) as eng:
        for prompts in waves:
            outs += eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.is_idle()
        eng.check_integrity()
        return outs, eng.stats()


def reference_draft(model, tokens: list[int], k: int, ids=None) -> list[torch.Tensor]:
    """The head's logits of each of ``k`` chained steps after ``tokens``, computed afresh: the
    target's prefill of all of them, the head's rows over the whole sequence (row q: token q
    and the target's hidden state at q - 1, zeros for token 0), then single steps on the
    head's own outputs, each fed its argmax (over the token ids ``ids`` only, if given: then
    the logits returned are of those tokens)."""
    n = len(tokens)
    kv, st = KVPool(model.kv_spec, n + k + 8), StatePool(model.state_spec, 2)
    slots, (slot,) = kv.alloc(n + k), st.alloc(1)
    st.clear([slot])
    ctx = ForwardContext.build([ForwardReq(0, tokens, slots, slot)], kv, st)
    _, hidden = model(ctx, return_hidden=True)
    before = torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]])
    out, logits = model.draft(ctx, before, torch.tensor(tokens))
    pick = (lambda x: x) if ids is None else (lambda x: x[ids])  # noqa: E731
    steps = [pick(logits[-1])]
    for s in range(1, k):
        token = int(steps[-1].argmax()) if ids is None else ids[int(steps[-1].argmax())]
        step_ctx = ForwardContext.build([ForwardReq(n - 1 + s, [token], slots, slot)], kv, st)
        out, logits = model.draft(step_ctx, out[-1:], torch.tensor([token]), step=s)
        steps.append(pick(logits[-1]))
    return steps


def draft_mismatches(model, drafts, ids=None) -> int:
    """How many recorded drafts differ from the fresh computation by more than a near tie (a
    chain is compared up to its first near tie, after which the two may fork). ``ids``: the
    token map the drafts were made over."""
    model.use_backend(create_backend("cpu"))
    bad = 0
    for tokens, draft in drafts:
        for token, logits in zip(draft, reference_draft(model, tokens, len(draft), ids)):
            if ids is not None:
                if token not in ids:
                    bad += 1
                    break
                token = ids.index(token)
            best = int(logits.argmax())
            if token == best:
                continue
            if float(logits[best] - logits[token]) > NEAR_TIE:
                bad += 1
            break
    return bad


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(CONFIGS[0], id="off", marks=pytest.mark.slow),
        pytest.param(CONFIGS[1], id="nobuf-p1"),
        pytest.param(CONFIGS[2], id="extra-p16-chunk"),
        pytest.param(CONFIGS[3], id="extra-p1", marks=pytest.mark.slow),
    ],
)
def test_greedy_outputs_equal_and_every_draft_is_the_sequences_own(models, monkeypatch, flags):
    """(The cache-off and extra_buffer page-1 cases are slow-marked: in the default run the
    seeded-sampling test runs both and finds the sampled tokens of decoding without
    speculation with the cache on and off.)"""
    model, plain, tok = models
    waves = _waves(model.vocab_size)
    ref, ref_stats = _run(plain, tok, waves, flags)
    rec = Recorder(monkeypatch)
    got, stats = _run(model, tok, waves, dict(flags, speculative_algorithm="MTP"))
    ties, worst = compare(ref, got)
    assert ties <= MAX_TIES and worst <= 10 * LOGPROB_ATOL, (flags, ties, worst)
    assert stats.spec_verify_ct == len(rec.drafts) > 20
    assert all(m["meta_info"]["spec_verify_ct"] > 0 for m in got)
    assert stats.cached_tokens == ref_stats.cached_tokens
    if not flags.get("disable_radix_cache"):
        assert stats.cached_tokens > 0  # the second wave resumed from the cache
    assert draft_mismatches(model, rec.drafts) == 0


def test_an_adaptive_cap_that_moves_every_step_keeps_outputs_hits_and_drafts(models, monkeypatch):
    """``--speculative-adaptive`` cuts each step's drafts to its cap: with the cap moving
    every step (3, 0, 1, 2) the head chains only as many steps as the cap allows, the outputs
    and hits equal the plain model's, and every draft is still the sequence's own."""
    model, plain, tok = models
    waves = _waves(model.vocab_size)
    flags = CONFIGS[1]
    ref, ref_stats = _run(plain, tok, waves, flags)
    caps = itertools.cycle([3, 0, 1, 2])
    monkeypatch.setattr(AdaptiveDrafts, "choose", lambda policy, reqs, drafts, batch: next(caps))
    drafts: list[tuple[list[int], list[int]]] = []  # the cut drafts, filled by the runner
    cut = RunningSet._drafts

    def recorded(running_set, decodes):
        out = cut(running_set, decodes)
        drafts.extend((r.token_slice(0, r.fed_len + 1), d) for r, d in out)
        return out

    monkeypatch.setattr(RunningSet, "_drafts", recorded)
    got, stats = _run(model, tok, waves, dict(flags, speculative_algorithm="MTP",
                                              speculative_adaptive=True))  # fmt: skip
    ties, worst = compare(ref, got)
    assert ties <= MAX_TIES and worst <= 10 * LOGPROB_ATOL, (ties, worst)
    assert {len(d) for _, d in drafts} >= {1, 2, 3}, drafts  # drafts cut to each cap
    assert stats.spec_draft_tokens == sum(len(d) for _, d in drafts)
    assert stats.cached_tokens == ref_stats.cached_tokens > 0
    assert draft_mismatches(model, drafts) == 0


def test_a_head_whose_snapshots_lack_the_hidden_state_drafts_differently(models, monkeypatch):
    """Negative control for the draft check: the hidden state left out of the snapshot slots
    (only working slots get it), so a request resumed from a snapshot starts its head rows from
    a stale hidden state."""
    model, _, tok = models
    original = mtp_module.hidden_rows

    def without_snapshots(layout):
        first_rows, working, _, _ = original(layout)
        last = [s + r.extend_len - 1 for r, s in zip(layout.reqs, layout.starts)]
        return first_rows, working, torch.tensor(last, dtype=torch.long), working

    monkeypatch.setattr(mtp_module, "hidden_rows", without_snapshots)
    rec = Recorder(monkeypatch)
    flags = dict(CONFIGS[3], speculative_algorithm="MTP")
    _run(model, tok, _waves(model.vocab_size), flags)
    assert draft_mismatches(model, rec.drafts) > 0


def test_draft_steps_run_no_state_operation_and_write_no_state(models, monkeypatch):
    """Each runner step applies its deferred state operations once, before its draft steps
    and forward; a draft step neither applies any nor changes a state slot."""
    model, _, tok = models
    events: list[str] = []
    apply, fill, run = StatePool.apply, DraftHead.fill, ModelRunner.run

    def counted_run(runner, batch):
        events.append("run")
        return run(runner, batch)

    def counted_apply(pool, ops):
        events.append("apply")
        return apply(pool, ops)

    def checked_fill(head, batch):
        before = [t.clone() for t in head.state_pool._tensors()]
        events.append("draft")
        fill(head, batch)
        events.append("draft-end")
        after = head.state_pool._tensors()
        assert all(torch.equal(a, b) for a, b in zip(before, after))

    monkeypatch.setattr(ModelRunner, "run", counted_run)
    monkeypatch.setattr(StatePool, "apply", counted_apply)
    monkeypatch.setattr(DraftHead, "fill", checked_fill)
    flags = dict(CONFIGS[3], speculative_algorithm="MTP")
    with Engine(model=model, tokenizer=tok, debug_integrity=True, skip_warmup=True, **POOLS,
                **flags) as eng:  # fmt: skip
        for prompts in _waves(model.vocab_size, seed=1):
            eng.generate(input_ids=prompts, sampling_params=GREEDY)
        drafted = eng.runner.draft_head.forwards
    assert drafted > 0 and "draft" in events
    # one apply per runner step, first; a step's draft steps between it and the forward
    for i, e in enumerate(events):
        if e == "run":
            assert events[i + 1] == "apply"
        if e == "draft":
            assert events[i - 1] == "apply" and events[i + 1] == "draft-end"
    assert events.count("apply") == events.count("run")


def test_seeded_sampling_equals_decoding_without_speculation(models):
    """Seeded sampling with MTP drafts gives the tokens decoding without speculation gives (each
    emitted token drawn from its row as decoding draws it: ``accept_point_drafts``), with the
    cache on and off; other seeds give other tokens."""
    model, plain, tok = models
    waves = _waves(model.vocab_size, seed=3)
    n = sum(len(w) for w in waves)
    params = [dict(temperature=0.8, top_p=0.9, seed=100 + i, max_new_tokens=12, ignore_eos=True)
              for i in range(n)]  # fmt: skip

    def run(m, flags, ps):
        outs = []
        with Engine(model=m, tokenizer=tok, debug_integrity=True, **POOLS, **flags) as eng:
            i = 0
            for prompts in waves:
                outs += eng.generate(input_ids=prompts, sampling_params=ps[i : i + len(prompts)])
                i += len(prompts)
            assert eng.stats().spec_verify_ct > 0 or not flags.get("speculative_algorithm")
        return [o["output_ids"] for o in outs]

    mtp = dict(CONFIGS[3], speculative_algorithm="MTP")
    on = run(model, mtp, params)
    assert on == run(plain, CONFIGS[3], params)
    # drafts, and where they are cut, do not depend on the cache
    assert run(model, dict(mtp, disable_radix_cache=True), params) == on
    assert run(model, mtp, [dict(p, seed=p["seed"] + 7) for p in params]) != on


def test_mtp_without_the_heads_weights_or_support_is_refused(models, tmp_path):
    _, plain, tok = models
    folder = tmp_path / "plain"
    make_tiny_checkpoint("qwen3_5", str(folder), seed=0)
    with pytest.raises(ValueError, match=r"no mtp\.\* weights"):
        Engine(model_path=str(folder), speculative_algorithm="MTP", skip_warmup=True)
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        Engine(model_path="tiny:granite_hybrid", speculative_algorithm="NEXTN", skip_warmup=True)
    with pytest.raises(ValueError, match="loaded without it"):
        Engine(model=plain, tokenizer=tok, speculative_algorithm="MTP", skip_warmup=True, **POOLS)


def test_a_token_map_drafts_from_its_tokens_only(models, monkeypatch, tmp_path):
    """``--speculative-token-map``: every draft token is in the map and is the argmax of the
    head's logits over the map's tokens; the outputs stay those without speculation."""
    model, plain, tok = models
    ids = list(range(3, model.vocab_size, 3))[::-1]  # a third of the vocabulary, any order
    path = tmp_path / "map.json"
    path.write_text(json.dumps(ids))
    waves = _waves(model.vocab_size, seed=4)
    ref, _ = _run(plain, tok, waves, CONFIGS[1])
    rec = Recorder(monkeypatch)
    flags = dict(CONFIGS[1], speculative_algorithm="MTP", speculative_token_map=str(path))
    got, _ = _run(model, tok, waves, flags)
    assert [g["output_ids"] for g in got] == [r["output_ids"] for r in ref]
    assert rec.drafts and all(t in ids for _, d in rec.drafts for t in d)
    assert draft_mismatches(model, rec.drafts, ids) == 0


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("map.pt", "[1, 2]", "pickled files are not read"),
        ("map.json", "{}", "non-empty JSON list"),
        ("map.json", "[1, 2.5]", "non-empty JSON list"),
        ("map.json", "[1, 99999999]", "outside the vocabulary"),
        ("map.json", "[4, 4]", "repeat"),
        ("map.json", "[4", "cannot read"),
    ],
)
def test_a_bad_token_map_is_refused_at_start(models, tmp_path, name, text, match):
    model, _, tok = models
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Engine(model=model, tokenizer=tok, speculative_algorithm="MTP", skip_warmup=True,
               speculative_token_map=str(path), **POOLS)  # fmt: skip
    with pytest.raises(ValueError, match="NEXTN / MTP"):
        Engine(model=model, tokenizer=tok, speculative_algorithm="NGRAM",
               speculative_token_map=str(path), **POOLS)  # fmt: skip


def test_drafts_after_a_restart_from_storage_are_the_sequences_own(models, monkeypatch, tmp_path):
    """The head's K/V and hidden state travel through the storage tier: a new engine on the
    same directory resumes the second wave's prefixes from storage and its drafts equal the
    fresh computation."""
    model, _, tok = models
    waves = _waves(model.vocab_size, seed=5, shared_len=100)  # past a 64-token storage block
    flags = dict(speculative_algorithm="MTP", enable_hierarchical_cache=True,
                 hicache_storage_dir=str(tmp_path), hicache_write_policy="write_through",
                 mamba_scheduler_strategy="no_buffer", page_size=1)  # fmt: skip
    _run(model, tok, waves[:1], flags)
    rec = Recorder(monkeypatch)
    _, stats = _run(model, tok, waves[1:], flags)
    assert stats.storage_hit_tokens > 0 and rec.drafts
    assert draft_mismatches(model, rec.drafts) == 0


def test_replayed_draft_steps_draft_as_the_python_path(models, monkeypatch):
    """Draft steps are recorded and replayed (``engine.step_graph``) and their drafts still
    equal the fresh computation; negative control: a replay whose hidden-state input is not
    refreshed (the buffer keeps the recorded step's) drafts differently."""
    model, _, tok = models
    waves = _waves(model.vocab_size, seed=6)[:1]

    def run(stale: bool):
        rec = Recorder(monkeypatch)
        if stale:
            fresh = _DraftStep.input

            def input_once(step, n, hidden):  # fills a size's buffer once only
                if n not in step._sizes:
                    fresh(step, n, hidden)

            monkeypatch.setattr(_DraftStep, "input", input_once)
        flags = dict(CONFIGS[1], speculative_algorithm="MTP")
        with Engine(model=model, tokenizer=tok, debug_integrity=True, **POOLS, **flags) as eng:
            for prompts in waves:
                eng.generate(input_ids=prompts, sampling_params=GREEDY)
            replayed = eng.runner.draft_head.graphs.stats["replayed"]
        return rec.drafts, replayed

    drafts, replayed = run(stale=False)
    assert replayed > 10
    assert draft_mismatches(model, drafts) == 0
    drafts, replayed = run(stale=True)
    assert replayed > 10 and draft_mismatches(model, drafts) > 0


def test_moe_model_with_its_head_equals_decoding_without(tmp_path, monkeypatch):
    """Qwen3-Next (sparse MoE MLPs, in the model and in its head): greedy outputs equal,
    drafts are the sequence's own."""
    make_tiny_checkpoint("qwen3_next", str(tmp_path), seed=0, mtp=True)
    model, plain = load_model(str(tmp_path), mtp=True), load_model(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    waves = _waves(model.vocab_size, seed=7)[:1]
    ref, _ = _run(plain, tok, waves, CONFIGS[2])
    rec = Recorder(monkeypatch)
    got, _ = _run(model, tok, waves, dict(CONFIGS[2], speculative_algorithm="MTP"))
    ties, worst = compare(ref, got)
    assert ties <= MAX_TIES and worst <= 10 * LOGPROB_ATOL, (ties, worst)
    assert rec.drafts and draft_mismatches(model, rec.drafts) == 0
