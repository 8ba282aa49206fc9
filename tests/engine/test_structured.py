"""Structured output through the engine (tiny random-weight Qwen3-Next): grammar-constrained
requests give valid output with overlap on or off, under retraction, for ``n`` copies of one
params object; min_tokens / stop strings / max_tokens / ignore_eos keep their meaning; logprobs
are the raw model's; a grammar that does not compile fails its request alone; with the mask
disabled the same requests give invalid output (the checks can fail)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
from engine_helpers import fake_engine

from mambaradix.core import GrammarSpec, SamplingParams
from mambaradix.engine.engine import Engine
from mambaradix.engine.outputs import RequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "null"}, "y": {"type": "string", "maxLength": 4}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "n", "tags", "ok", "inner"],
    "additionalProperties": False,
}
PROMPTS = ["Give me JSON:", "A record", "hello there, model", "{", "List three things", "x y z"]


def _engine(**flags) -> Engine:
    flags.setdefault("max_total_tokens", 8192)
    flags.setdefault("max_mamba_cache_size", 64)
    return Engine(model_path="tiny:qwen3_next", skip_warmup=True, debug_integrity=True, **flags)


@pytest.fixture(scope="module")
def eng():
    e = _engine()
    yield e
    e.shutdown()


def _json_params(**kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 200)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(grammar=GrammarSpec.from_json_schema(SCHEMA), **kw)


def _valid(out: dict) -> bool:
    if out["meta_info"]["finish_reason"] != "stop":
        return False
    try:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _run(eng: Engine, params: list[SamplingParams]) -> list[dict]:
    ids = [eng.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(len(params))]
    outs = [h.result() for h in eng.submit_many(ids, params)]
    eng.check_integrity()
    return outs


def test_json_schema_valid_and_logprobs_are_the_raw_models(eng):
    ids = eng.tokenizer.encode(PROMPTS[0])
    out = eng.submit(ids, _json_params(return_logprob=True)).result()
    assert _valid(out), out
    got = out["meta_info"]["output_token_logprobs"]
    # the raw model's logprob of each output token: prompt logprobs of prompt + output
    ref_params = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprob_start=len(ids))
    first = next(iter(eng.submit(ids + out["output_ids"], ref_params).events()))
    assert got == pytest.approx(first.prompt_logprobs, abs=1e-4)
    # masked logprobs would be 0 wherever the grammar allows one token ('{', '"name":', ...)
    assert min(got) < -0.5


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_on_and_off_give_the_same_valid_outputs(eng, overlap):
    """Under overlap the mask of a row is filled before the batch's tokens are known; it
    needs the previous token accepted. Seeded sampling, so the masks shape every token."""
    params = [_json_params(temperature=0.8, seed=100 + i) for i in range(6)]
    want = _run(eng, params)
    assert all(_valid(o) for o in want)
    other = _engine(disable_overlap_schedule=not overlap, page_size=4)
    try:
        got = _run(other, [_json_params(temperature=0.8, seed=100 + i) for i in range(6)])
    finally:
        other.shutdown()
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_n_copies_of_one_params_object_each_have_their_own_matcher(eng):
    p = _json_params(temperature=1.0)  # one object for all copies, as the server passes it
    outs = _run(eng, [p] * 6)
    assert all(_valid(o) for o in outs), [o["text"] for o in outs]
    assert len({o["text"] for o in outs}) > 1


def test_retraction_keeps_the_matcher(eng):
    want = _run(eng, [_json_params(max_new_tokens=150) for _ in range(8)])
    small = _engine(max_total_tokens=256, max_running_requests=8)
    try:
        got = _run(small, [_json_params(max_new_tokens=150) for _ in range(8)])
        assert small.stats().retractions > 0
    finally:
        small.shutdown()
    assert all(_valid(o) for o in got)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def _regex(pattern: str, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_new_tokens", 40)
    return SamplingParams(grammar=GrammarSpec("regex", pattern), **kw)


def test_stop_strings_max_tokens_ignore_eos_min_tokens(eng):
    ids = eng.tokenizer.encode("say it")
    out = eng.submit(ids, _regex("hello world", stop=["wor"])).result()
    assert (out["text"], out["meta_info"]["finish_reason"]) == ("hello ", "stop")
    out = eng.submit(ids, _regex("x{30}", max_new_tokens=3)).result()
    assert out["meta_info"]["finish_reason"] == "length"
    assert re.fullmatch("x+", out["text"]) and len(out["output_ids"]) == 3
    # ignore_eos: the request still ends where its grammar ends
    out = eng.submit(ids, _regex("ab", ignore_eos=True)).result()
    assert (out["text"], out["meta_info"]["finish_reason"]) == ("ab", "stop")
    # min_tokens keeps EOS out while the grammar may go on...
    out = eng.submit(ids, _regex("a+", min_tokens=5, max_new_tokens=8)).result()
    assert re.fullmatch("a+", out["text"]) and len(out["output_ids"]) >= 5
    # ...and cannot stop a grammar that may only end
    out = eng.submit(ids, _regex("ab", min_tokens=5)).result()
    assert (out["text"], out["meta_info"]["finish_reason"]) == ("ab", "stop")


def test_a_grammar_that_does_not_compile_fails_alone(eng):
    bad = SamplingParams(max_new_tokens=8, grammar=GrammarSpec("ebnf", 'root ::= "a" nowhere'))
    ids = eng.tokenizer.encode("hi")
    good = [eng.submit(ids, _regex("[0-9]{3}")) for _ in range(3)]
    broken = eng.submit(ids, bad)
    with pytest.raises(RequestError, match="grammar"):
        broken.result()
    assert all(re.fullmatch("[0-9]{3}", h.result()["text"]) for h in good)
    assert eng.health().status == "ok"
    eng.check_integrity()


def test_no_tokenizer_is_a_clear_error():
    with fake_engine() as e:
        with pytest.raises(ValueError, match="tokenizer"):
            e.submit([1, 2, 3], _regex("a"))


def test_negative_control_without_the_mask_output_is_invalid(eng, monkeypatch):
    monkeypatch.setattr(eng.structured, "start", lambda batch: None)
    outs = _run(eng, [_json_params(max_new_tokens=40) for _ in range(4)])
    assert not any(_valid(o) for o in outs)


@pytest.mark.parametrize("abort", [True, False])
def test_a_request_aborted_while_its_grammar_compiles_ends_aborted(eng, monkeypatch, abort):
    compiled = eng.structured.compiler.compile(GrammarSpec("regex", "abc"))
    pending: Future = Future()  # the compile, finished by hand below
    monkeypatch.setattr(eng.structured, "compile_async", lambda spec, gate=None: pending)
    handle = eng.submit(eng.tokenizer.encode("go"), _regex("abc"))
    if abort:
        eng.abort(handle.rid)
    eng.call(lambda: None)  # the engine thread has seen the abort (the request is not queued)
    pending.set_result(compiled)
    last = list(handle.events())[-1]
    assert last.finish_reason == ("abort" if abort else "stop")
    eng.check_integrity()
