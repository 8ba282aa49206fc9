"""Pure pieces of the engine: snapshot planning, sampling, incremental detokenization."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import GREEDY, fake_engine, rand_tokens

from mambaradix.core import SamplingParams
from mambaradix.engine.detokenizer import DetokState, IncrementalDetokenizer, find_stop, holdback
from mambaradix.engine.planner import (
    admission_targets,
    branch_points,
    common_prefix_len,
    plan_forward,
    snapshot_alignment,
)
from mambaradix.engine.sampler import sample


def test_alignment_is_whole_pages_and_at_least_64():
    assert [snapshot_alignment(p) for p in (1, 16, 48, 64, 128)] == [64, 64, 96, 64, 128]


def test_admission_targets():
    # lookup matched KV to 300 without a state; a waiting request shares 700; prompt of 1000
    got = admission_targets(seq_len=1000, prefix_len=0, kv_len=300, queue_branch=700, align=64)
    assert got == [256, 640, 960]
    exact = admission_targets(
        seq_len=1000, prefix_len=0, kv_len=0, queue_branch=0, align=64, repeat_align=1
    )
    assert exact == [999]
    paged = admission_targets(
        seq_len=1000, prefix_len=0, kv_len=0, queue_branch=0, align=64, repeat_align=16
    )
    assert paged == [992]
    # nothing at or below the resumed prefix
    assert admission_targets(seq_len=100, prefix_len=64, kv_len=64, queue_branch=0, align=64) == []
    # the caller's branch points, when given, are the ones used (not computed again)
    args = dict(seq_len=1000, prefix_len=0, kv_len=300, queue_branch=700, align=64)
    assert admission_targets(**args, branches=branch_points(1000, 0, 300, 700, 64)) == got
    assert admission_targets(**args, branches={128}) == [128, 960]


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_plan_forward(strategy):
    # one wanted position inside the chunk
    seg = plan_forward(0, 512, 1000, [256], 64, strategy)
    if strategy == "no_buffer":
        assert (seg.end, seg.snapshot) == (256, 256)  # cut: the copy happens at the boundary
    else:
        assert (seg.end, seg.snapshot) == (512, 256)  # tracked inside the forward
    # a non-final chunk snapshots its aligned end; the final chunk does not
    assert plan_forward(0, 500, 1000, [], 64, strategy).snapshot == 448
    assert plan_forward(512, 1000, 1000, [], 64, strategy).snapshot is None
    # two wanted positions: the forward ends at the first
    seg = plan_forward(0, 512, 1000, [128, 320], 64, strategy)
    assert (seg.end, seg.snapshot) == (128, 128)


def test_common_prefix_len():
    a = np.array([1, 2, 3, 4])
    assert common_prefix_len(a, np.array([1, 2, 9])) == 2
    assert common_prefix_len(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix_len(a, np.array([], dtype=np.int64)) == 0


def test_sampler_filters():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.9, 0.5, -1.0, -3.0]] * 400)
    gen = torch.Generator().manual_seed(3)

    def draw(**kw):
        p = SamplingParams(temperature=1.0, **kw)
        toks, lps, _ = sample(logits, [p] * 400, [gen] * 400)
        return set(toks), lps

    assert draw(top_k=1)[0] == {0}
    assert draw(top_k=2)[0] == {0, 1}
    assert draw(top_p=0.3)[0] == {0}
    assert draw(min_p=0.5)[0] == {0, 1}  # p(2) / p(0) = e^-1.5 < 0.5
    assert draw()[0] >= {0, 1, 2}
    toks, lps, _ = sample(logits[:1], [SamplingParams(temperature=0.0)], [None])
    assert toks == [0] and lps[0] == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())


def test_sampler_logprobs_without_a_full_log_softmax(monkeypatch):
    """The chosen tokens' logprobs and the top alternatives come from one argmax/logsumexp pass
    over each row (no [B, V] log_softmax) and equal the float64 log_softmax (within 1e-6: fp32's
    log_softmax itself is 5e-6 off here); a grammar-masked row still reports the model's own
    distribution. Control: a sampler that reported logits as logprobs would fail."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 70000, generator=g) * 4
    want = torch.log_softmax(logits.double(), -1)
    monkeypatch.setattr(torch, "log_softmax", lambda *a, **k: pytest.fail("full log_softmax"))
    ps = [SamplingParams(temperature=0.0, top_logprobs=k) for k in (0, 3, 5)]
    toks, lps, top = sample(logits.clone(), ps, [None] * 3)
    assert toks == want.argmax(-1).tolist()
    assert lps == pytest.approx(want.max(-1).values.tolist(), abs=1e-6)
    assert top[0] is None
    for row, (ids, values) in zip((1, 2), top[1:]):
        best = want[row].topk(ps[row].top_logprobs)
        assert ids == best.indices.tolist()
        assert values == pytest.approx(best.values.tolist(), abs=1e-6)
    assert lps != pytest.approx(logits.max(-1).values.tolist(), abs=1e-3)

    def only_token_7(rows):  # a grammar allowing one token
        keep = rows[:, 7].clone()
        rows.fill_(float("-inf"))
        rows[:, 7] = keep

    toks, lps, _ = sample(logits[:1].clone(), ps[:1], [None], constrain=only_token_7)
    assert toks == [7] and lps == pytest.approx([want[0, 7].item()], abs=1e-6)


class ByteTokenizer:
    """Each id is one byte; multi-byte characters span several ids."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_matches_full_decode():
    text = "héllo wörld ✓ done"
    ids = list(text.encode())
    detok = IncrementalDetokenizer(ByteTokenizer())
    st = DetokState()
    seen = []
    for i in range(1, len(ids) + 1):
        before = len(st.text)
        detok.step(st, ids[:i])
        seen.append(st.text[before:])
        assert "\ufffd" not in st.text  # never emits half a character
    detok.flush(st, ids)
    assert st.text == text and "".join(seen) == text


def test_stop_string_helpers():
    assert find_stop("abc STOP def", ["STOP"], 0) == (4, "STOP")
    assert find_stop("abc", ["STOP"], 0) is None
    assert holdback("the end ST", ["STOP"]) == 2
    assert holdback("the end", ["STOP"]) == 0


def test_lpm_policy_same_outputs_and_hits(rng):
    system = rand_tokens(rng, 200)
    prompts = [system + rand_tokens(rng, 30) for _ in range(8)] + [rand_tokens(rng, 90)]
    with fake_engine() as eng:
        fcfs = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    with fake_engine(schedule_policy="lpm") as eng:
        lpm = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in lpm] == [r["output_ids"] for r in fcfs]
    assert sum(r["meta_info"]["cached_tokens"] >= 192 for r in lpm) == 7


def test_token_slice_spans_prompt_outputs_and_placeholders():
    from mambaradix.engine.request import Req

    r = Req(rid="x", prompt_ids=[1, 2, 3, 4], params=SamplingParams())
    r.output_ids, r.futures = [5, 6], [-7, -8]
    full = [1, 2, 3, 4, 5, 6, -7, -8]
    for a in range(9):
        for b in range(a, 9):
            assert r.token_slice(a, b) == full[a:b]


def test_detokenizer_decodes_like_the_tokenizer_with_specials_and_cleanup():
    """The Rust shortcut gives what ``tokenizer.decode`` gives (special tokens kept or skipped);
    a tokenizer that cleans up spaces keeps going through ``decode``."""
    import random

    from mambaradix.models.loader import load_tokenizer, resolve_model_path

    tok = load_tokenizer(resolve_model_path("tiny:qwen3_next"))
    rng = random.Random(5)
    specials = list(tok.all_special_ids)
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        for _ in range(50):
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
            assert detok._decode(ids) == tok.decode(ids, skip_special_tokens=skip)
        st = DetokState()
        ids = tok.encode("Hello, the quick brown fox <|im_end|> and more text here.")
        for i in range(1, len(ids) + 1):
            detok.step(st, ids[:i])
        detok.flush(st, ids)
        assert st.text == tok.decode(ids, skip_special_tokens=skip)

    class Cleaning:
        clean_up_tokenization_spaces = True
        backend_tokenizer = tok.backend_tokenizer

        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens) + "|cleaned"

    assert IncrementalDetokenizer(Cleaning())._decode([5, 6]).endswith("|cleaned")
