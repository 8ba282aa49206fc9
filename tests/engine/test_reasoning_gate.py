"""A grammar behind a reasoning gate (``SamplingParams.reasoning_gate``, what the chat route
sets under ``--reasoning-parser``): the reply's reasoning is the model's own, token for token
and logprob for logprob; from the first token after the end tag on (whitespace free in
between) the output follows the grammar. The matcher's phases are checked token by token on
the tiny tokenizer, where ``</think>`` is seven tokens; the engine's masks through real
requests on the tiny Qwen3-Next, with an end tag the greedy model is known to write."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from mambaradix.core import FieldError, GrammarSpec, ReasoningGate, SamplingParams
from mambaradix.engine.engine import Engine
from mambaradix.engine.grammar import (
    MAX_SPACE_TOKENS,
    GateVocab,
    GrammarCompiler,
    GrammarMatcher,
)
from mambaradix.engine.logits_process import ThinkingBudget
from mambaradix.engine.structured import BatchMasks

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}
GRAMMAR = GrammarSpec.from_json_schema(SCHEMA)


@pytest.fixture(scope="module")
def eng():
    e = Engine(
        model_path="tiny:qwen3_next", skip_warmup=True, debug_integrity=True,
        max_total_tokens=4096, max_mamba_cache_size=32,
    )  # fmt: skip
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def compiler(eng):
    c = GrammarCompiler(eng.tokenizer, eng.model.vocab_size)
    yield c
    c.close()


def _ids(eng, text: str) -> list[int]:
    return eng.tokenizer.encode(text, add_special_tokens=False)


def _matcher(compiler, gate: ReasoningGate) -> GrammarMatcher:
    vocab = compiler.gate_vocab(gate)
    return GrammarMatcher(compiler.compile(GRAMMAR), compiler.vocab_size, vocab, gate.thinking)


def _feed(m: GrammarMatcher, ids: list[int]) -> list[tuple[str, bool]]:
    """(phase before the token, accepted) per token."""
    return [(m.phase, m.accept(t)) for t in ids]


def test_the_end_tag_is_found_however_the_tokens_spell_it(eng, compiler):
    gate = ReasoningGate()
    assert len(_ids(eng, "</think>")) > 1  # the tiny tokenizer has no single-token tag
    for pieces in (["I think so</think>"], ["I think so</th", "ink>"], ["a<", "/", "think", ">"]):
        m = _matcher(compiler, gate)
        ids = [t for p in pieces for t in _ids(eng, p)]
        steps = _feed(m, ids)
        assert all(ok for _, ok in steps)
        assert [ph for ph, _ in steps] == ["thinking"] * len(ids)
        assert m.phase == "after" and m.constrains()
    # a tag that is not complete keeps the reply free; one more character ends it
    m = _matcher(compiler, gate)
    _feed(m, _ids(eng, "</think </thin"))
    assert m.phase == "thinking" and not m.constrains()
    _feed(m, _ids(eng, "k>"))
    assert m.phase == "after"


def test_after_the_tag_whitespace_is_free_then_the_grammar_binds(eng, compiler):
    m = _matcher(compiler, ReasoningGate())
    _feed(m, _ids(eng, "hmm</think>"))
    space = _ids(eng, "\n\n ")
    assert all(ok for _, ok in _feed(m, space)) and m.phase == "after"
    assert not m.accept(_ids(eng, "x")[0])  # not JSON: refused, the matcher unchanged
    assert m.phase == "after"
    assert all(ok for _, ok in _feed(m, _ids(eng, '{"a":7}')))
    assert m.phase == "grammar"
    assert not m.accept(space[0])  # whitespace is the grammar's business now (compact JSON)
    assert m.accept(eng.tokenizer.eos_token_id) and m.is_terminated()
    # whitespace is free for MAX_SPACE_TOKENS tokens, then the grammar binds
    m = _matcher(compiler, ReasoningGate())
    _feed(m, _ids(eng, "hmm</think>"))
    nl = _ids(eng, "\n")[0]
    assert all(ok for _, ok in _feed(m, [nl] * MAX_SPACE_TOKENS)) and m.phase == "grammar"
    assert not m.accept(nl)


def test_a_token_that_spells_past_the_tag_feeds_the_grammar(eng, compiler):
    vocab = compiler.gate_vocab(ReasoningGate())
    t_ok, t_bad = 5, 6  # two tokens given other bytes, in a copy of the tables
    spelled = GateVocab.__new__(GateVocab)
    spelled.__dict__.update(vocab.__dict__)
    spelled.token_bytes = list(vocab.token_bytes)
    spelled.token_bytes[t_ok] = b'k>\n{"a":'
    spelled.token_bytes[t_bad] = b"k> no"
    m = GrammarMatcher(compiler.compile(GRAMMAR), compiler.vocab_size, spelled, True)
    _feed(m, _ids(eng, "ok</thin"))
    assert not m.accept(t_bad) and m.phase == "thinking"  # refused, the matcher unchanged
    assert m.accept(t_ok) and m.phase == "grammar"
    assert all(ok for _, ok in _feed(m, [*_ids(eng, "3}"), eng.tokenizer.eos_token_id]))
    assert m.is_terminated()


def test_start_phase_allows_the_grammar_or_the_start_tag(eng, compiler):
    # a one-token start tag (real thinking tokenizers have <think> as one added token): the
    # tiny tokenizer's <|im_start|> stands in for it
    gate = ReasoningGate(start="<|im_start|>", thinking=False)
    start_id = eng.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert compiler.gate_vocab(gate).start_ids == {start_id}
    m = _matcher(compiler, gate)
    assert m.phase == "start" and m.constrains()
    assert m.accept(start_id) and m.phase == "thinking"
    m = _matcher(compiler, gate)
    assert not m.accept(_ids(eng, "x")[0])
    assert m.accept(_ids(eng, "{")[0]) and m.phase == "grammar"
    assert not m.accept(start_id)  # once the answer began, the tag is just a refused token


def test_masks_follow_the_phases(eng, compiler):
    """One batch of four gated rows, one per phase: the thinking row gets no mask; the others
    the grammar's, the start row with the start tag beside it, the after row with whitespace."""
    gate = ReasoningGate(start="<|im_start|>")
    rows = [_matcher(compiler, gate) for _ in range(4)]
    _feed(rows[1], _ids(eng, "x</think>"))  # after
    _feed(rows[2], _ids(eng, 'x</think>{"a"'))  # grammar
    rows[3] = _matcher(compiler, ReasoningGate(start="<|im_start|>", thinking=False))  # start
    bitmask = compiler.allocate_bitmask(8)
    masks = BatchMasks(compiler, list(enumerate(rows)), bitmask, None)
    logits = torch.zeros(4, compiler.vocab_size)
    masks.apply(logits)
    allowed = [set(torch.nonzero(r == 0).flatten().tolist()) for r in logits]
    vocab = compiler.gate_vocab(gate)
    fresh = GrammarMatcher(compiler.compile(GRAMMAR), compiler.vocab_size)  # no gate
    ref = compiler.allocate_bitmask(1)
    compiler.fill_masks([fresh], ref, [0])
    bits = np.unpackbits(ref[0].numpy().view(np.uint8), bitorder="little")
    first = set(np.flatnonzero(bits[: compiler.vocab_size]).tolist())
    start_id = eng.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert allowed[0] == set(range(compiler.vocab_size))  # thinking: untouched
    assert allowed[1] == first | vocab.space_ids and vocab.space_ids - first
    colon = _ids(eng, ":")[0]
    assert colon in allowed[2] and _ids(eng, "{")[0] not in allowed[2]
    assert not allowed[2] & (vocab.space_ids | {start_id})
    assert allowed[3] == first | {start_id}
    # every row's token is accepted, the thinking row's too (it looks for the tag)
    errors: dict = {}
    tokens = [_ids(eng, "<")[0], _ids(eng, " ")[0], colon, start_id]
    assert masks.accept(tokens, errors) == set() and not errors
    assert [m.phase for m in rows] == ["thinking", "after", "grammar", "thinking"]
    assert rows[0]._tail == b"<"


def _bytes(eng, ids: list[int]) -> list[bytes]:
    vocab = eng.structured.compiler.gate_vocab(ReasoningGate())
    return [vocab.token_bytes[t] for t in ids]


def _plain(eng, prompt: list[int], n: int) -> dict:
    p = SamplingParams(max_new_tokens=n, temperature=0, return_logprob=True, ignore_eos=True)
    return eng.submit(prompt, p).result()


def test_reasoning_is_the_models_own_then_the_answer_follows_the_grammar(eng):
    """The end tag is the text of the greedy model's first three tokens, so the gated request
    must reason exactly those tokens and then answer in the grammar. Without the gate, the
    grammar binds from the first token and the reply changes at once (the control)."""
    for text in ("Please think, then answer in JSON:", "Why is the sky blue?", "hello", "A B C"):
        prompt = _ids(eng, text)
        free = _plain(eng, prompt, 8)
        head = free["output_ids"][:3]
        tag = eng.tokenizer.decode(head)  # a tag of whole characters (random tokens may split one)
        if "\ufffd" not in tag and tag.encode() == b"".join(_bytes(eng, head)):
            break
    else:
        pytest.fail("no prompt whose greedy reply starts with three whole-character tokens")
    gate = ReasoningGate(end=tag)
    params = SamplingParams(
        max_new_tokens=40, temperature=0, return_logprob=True, grammar=GRAMMAR, reasoning_gate=gate
    )
    outs = [h.result() for h in eng.submit_many([prompt] * 2, [params, params])]
    eng.check_integrity()
    for out in outs:
        assert out["output_ids"][:3] == head
        lps = out["meta_info"]["output_token_logprobs"]
        assert lps[:3] == pytest.approx(free["meta_info"]["output_token_logprobs"][:3], abs=1e-5)
        answer = eng.tokenizer.decode(out["output_ids"][3:], skip_special_tokens=True)
        jsonschema.validate(json.loads(answer), SCHEMA)
        assert out["meta_info"]["finish_reason"] == "stop"
    bare = SamplingParams(max_new_tokens=40, temperature=0, grammar=GRAMMAR)
    control = eng.submit(prompt, bare).result()
    assert control["output_ids"][:3] != head
    jsonschema.validate(json.loads(control["text"]), SCHEMA)


def test_a_reply_that_never_closes_its_reasoning_is_never_masked(eng):
    prompt = _ids(eng, "Think forever:")
    free = _plain(eng, prompt, 12)
    gated = SamplingParams(
        max_new_tokens=12, temperature=0, return_logprob=True, ignore_eos=True, grammar=GRAMMAR,
        reasoning_gate=ReasoningGate(),
    )  # fmt: skip
    out = eng.submit(prompt, gated).result()
    assert out["output_ids"] == free["output_ids"]
    assert out["meta_info"]["finish_reason"] == "length"


def test_a_gate_needs_a_grammar_or_a_budget():
    with pytest.raises(FieldError, match="reasoning_gate"):
        SamplingParams(reasoning_gate=ReasoningGate()).validate(100)
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningGate(end="")


# ---------------------------------------------------------------------- thinking budget


def _budget_run(b: ThinkingBudget, tokens: list[int]) -> list[int | None]:
    """What the budget forced before each token (None: free), accepting the token."""
    out = []
    for t in tokens:
        out.append(b.forced())
        b.accept(t)
    return out


def test_thinking_budget_forces_the_rest_of_the_end_tag():
    end = [7, 8, 9]
    b = ThinkingBudget(3, [5], end, thinking=True)
    # three tokens of reasoning, then the tag forced token by token, then free again
    assert _budget_run(b, [1, 2, 3, 7, 8, 9, 4]) == [None, None, None, 7, 8, 9, None]
    assert b.phase == "done"
    # the tag's own tokens are not reasoning: a reply writing it at its last budget token
    # is not cut; a budget spent by a false start of the tag (7 8, then 7 again) completes the
    # tag the reply is writing from where it stands
    b = ThinkingBudget(1, [5], end, thinking=True)
    assert _budget_run(b, [7, 8, 9]) == [None, None, None]
    b = ThinkingBudget(3, [5], end, thinking=True)
    assert _budget_run(b, [1, 7, 8, 7, 8, 9]) == [None, None, None, None, 8, 9]
    # a false start of the tag counts as reasoning
    b = ThinkingBudget(3, [5], end, thinking=True)
    assert _budget_run(b, [7, 8, 1, 7, 8, 9]) == [None, None, None, 7, 8, 9]
    # a reply that closes the block in budget is never forced
    b = ThinkingBudget(10, [5], end, thinking=True)
    assert _budget_run(b, [1, 7, 8, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1]) == [None] * 13
    # budget 0: the tag at once; a reply that opens no block is not capped
    assert _budget_run(ThinkingBudget(0, [5], end, thinking=True), [7, 8, 9]) == [7, 8, 9]
    b = ThinkingBudget(0, [5, 6], end, thinking=False)
    assert _budget_run(b, [5, 6, 7, 8, 9]) == [None, None, 7, 8, 9]
    b = ThinkingBudget(0, [5, 6], end, thinking=False)
    assert _budget_run(b, [5, 1, 1]) == [None, None, None] and b.phase == "done"


def test_thinking_budget_caps_the_reasoning_then_the_reply_goes_on(eng):
    """Budget 4 on a reply that starts inside its block and never closes it: four tokens of
    the model's own reasoning (its logprobs too), then the end tag's tokens, then the model's
    own answer; with a grammar the answer follows it. Without the budget the reply is the free
    one (the control)."""
    prompt = _ids(eng, "Think briefly:")
    free = _plain(eng, prompt, 16)
    end = _ids(eng, "</think>")
    gate = ReasoningGate()
    capped = SamplingParams(
        max_new_tokens=16, temperature=0, return_logprob=True, ignore_eos=True,
        reasoning_gate=gate, thinking_budget=4,
    )  # fmt: skip
    out = eng.submit(prompt, capped).result()
    ids = out["output_ids"]
    assert ids[:4] == free["output_ids"][:4] and ids[4 : 4 + len(end)] == end
    assert ids[:4] + end != free["output_ids"][: 4 + len(end)]
    lps = out["meta_info"]["output_token_logprobs"]
    assert lps[:4] == pytest.approx(free["meta_info"]["output_token_logprobs"][:4], abs=1e-5)
    # the answer is the model's free continuation of prompt + reasoning + tag
    rest = _plain(eng, prompt + ids[: 4 + len(end)], 16 - 4 - len(end))
    assert ids[4 + len(end) :] == rest["output_ids"]
    eng.check_integrity()
    # with a grammar: the answer follows it
    bound = SamplingParams(
        max_new_tokens=40, temperature=0, grammar=GRAMMAR, reasoning_gate=gate, thinking_budget=4
    )
    out = eng.submit(prompt, bound).result()
    assert out["output_ids"][:4] == free["output_ids"][:4]
    text = eng.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    jsonschema.validate(json.loads(text.split("</think>", 1)[1]), SCHEMA)
    assert out["meta_info"]["finish_reason"] == "stop"
    # sampled, seeded: still four tokens, then the tag
    seeded = SamplingParams(
        max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True, reasoning_gate=gate,
        thinking_budget=4,
    )  # fmt: skip
    assert eng.submit(prompt, seeded).result()["output_ids"][4 : 4 + len(end)] == end


def test_thinking_budget_fields_are_checked():
    with pytest.raises(FieldError, match="thinking_budget"):
        SamplingParams(thinking_budget=3).validate(100)
    with pytest.raises(FieldError, match="thinking_budget"):
        SamplingParams(thinking_budget=-2, reasoning_gate=ReasoningGate()).validate(100)
    SamplingParams(thinking_budget=0, reasoning_gate=ReasoningGate()).validate(100)
