"""Grammar-constrained decoding (engine/grammar.py): random logits masked by the grammar must
always produce output that the spec accepts, and bad specs are ValueErrors. (A request's fields
turned into a spec, and their 400s: tests/server/test_grammar_fields.py.)"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from mambaradix.engine.grammar import GrammarCompiler, GrammarMatcher, GrammarSpec, validate_spec
from mambaradix.engine.structured import BatchMasks
from mambaradix.models.loader import load_tokenizer, resolve_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grammar_schemas import SCHEMAS  # noqa: E402

PAD = 37  # logits rows past the tokenizer's vocabulary (as models pad their vocab)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_path("tiny:qwen3_next"))


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, len(tok) + PAD, cache_size=8)
    yield c
    c.close()


def new_matcher(compiler: GrammarCompiler, spec: GrammarSpec) -> GrammarMatcher:
    """A request's matcher as the engine makes it (``StructuredOutput.attach``)."""
    return GrammarMatcher(compiler.compile(spec), compiler.vocab_size)


def mask_rows(compiler, logits: torch.Tensor, rows: dict[int, GrammarMatcher]) -> None:
    """Mask ``logits`` ([B, V], or one row [V]) in place by the engine's path for a batch's
    grammar rows (``BatchMasks``: fill the rows' bitmasks, apply them); other rows untouched."""
    view = logits.view(1, -1) if logits.dim() == 1 else logits
    bitmask = compiler.allocate_bitmask(max(len(rows), 1))
    BatchMasks(compiler, list(rows.items()), bitmask, None).apply(view)


def drive(compiler, matcher, tok, seed: int, max_steps: int = 400, bias=None) -> str:
    """Greedy argmax of seeded random logits (+ ``bias``) under the mask until the grammar
    terminates; returns the decoded text without the stop token."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(compiler.vocab_size, generator=g)
        if bias is not None:
            logits += bias
        mask_rows(compiler, logits, {0: matcher})
        assert torch.isinf(logits[len(tok) :]).all(), "padded rows must be masked"
        t = int(logits.argmax())
        assert matcher.accept(t)
        if matcher.is_terminated():
            assert t in compiler.stop_token_ids
            return tok.decode(out)
        assert t not in compiler.stop_token_ids
        out.append(t)
    pytest.fail(f"grammar did not terminate within {max_steps} steps: {tok.decode(out)!r}")


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_random_logits_always_valid(compiler, tok, i):
    schema = SCHEMAS[i]
    spec = GrammarSpec.from_json_schema(schema)
    for seed in range(3):
        text = drive(compiler, new_matcher(compiler, spec), tok, seed=1000 * i + seed)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        # no free whitespace: the text is the compact serialisation
        assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_bounded_string_refuses_control_characters(compiler, tok):
    """xgrammar's bounded-string class lets U+0000..U+001F through; ours must not."""
    m = new_matcher(compiler, GrammarSpec.from_json_schema({"type": "string", "maxLength": 5}))
    assert m.accept(tok.encode('"', add_special_tokens=False)[0])
    logits = torch.zeros(compiler.vocab_size)
    mask_rows(compiler, logits, {0: m})
    control = [i for i in range(len(tok)) if any(ord(ch) < 0x20 for ch in tok.decode([i]))]
    assert control  # the byte tokens are there
    assert torch.isinf(logits[control]).all()
    assert torch.isfinite(logits).sum() > 100


def test_twenty_schemas():
    assert len(SCHEMAS) == 20


def test_json_schema_and_json_object(compiler, tok):
    schema = SCHEMAS[6]
    spec = GrammarSpec.from_json_schema(schema)
    jsonschema.validate(json.loads(drive(compiler, new_matcher(compiler, spec), tok, 7)), schema)
    obj = GrammarSpec("json_object")
    # json_object is unbounded: random logits leaning towards closing tokens, so it ends
    bias = torch.zeros(compiler.vocab_size)
    for text in ('"', "}", "]", "0", "1", ","):
        bias[tok.encode(text, add_special_tokens=False)] = 3.0
    bias[compiler.stop_token_ids] = 3.0
    for seed in range(3):
        text = drive(compiler, new_matcher(compiler, obj), tok, seed, max_steps=2000, bias=bias)
        assert isinstance(json.loads(text), dict)


def test_regex(compiler, tok):
    pattern = r"[a-c]{2,4}-\d{1,3}(x|yz)?"
    spec = GrammarSpec("regex", pattern)
    for seed in range(5):
        assert re.fullmatch(pattern, drive(compiler, new_matcher(compiler, spec), tok, seed))


def test_ebnf(compiler, tok):
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" num\nnum ::= [1-9] [0-9]?\n'
    spec = GrammarSpec("ebnf", grammar)
    for seed in range(5):
        text = drive(compiler, new_matcher(compiler, spec), tok, seed)
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", text), text


def test_negative_control_without_mask_not_json(tok):
    g = torch.Generator().manual_seed(0)
    V = len(tok)
    bad = 0
    for _ in range(5):
        ids = [int(torch.randn(V, generator=g).argmax()) for _ in range(30)]
        try:
            json.loads(tok.decode(ids))
        except ValueError:
            bad += 1
    assert bad == 5


def test_bad_specs_raise_value_error():
    cases = [
        GrammarSpec("json_schema", "[1, 2]"),
        GrammarSpec.from_json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
        GrammarSpec.from_json_schema({"type": "nosuchtype"}),
        GrammarSpec.from_json_schema({"type": "string", "pattern": "a+", "maxLength": 3}),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("ebnf", "root ::= undefined_rule"),
    ]
    for spec in cases:
        with pytest.raises(ValueError, match=r"^answer\.field: "):  # names the caller's field
            validate_spec(spec, "answer.field")
    validate_spec(GrammarSpec.from_json_schema({"type": "string", "maxLength": 3}))  # control
    with pytest.raises(ValueError):
        GrammarSpec("yaml")


def test_bad_spec_at_compile_is_value_error(compiler):
    with pytest.raises(ValueError, match="regex"):
        compiler.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(ValueError):
        compiler.compile_async(GrammarSpec("ebnf", "root ::= nope")).result()


def test_stop_token_only_when_complete(compiler, tok):
    m = new_matcher(compiler, GrammarSpec("regex", "ab"))
    eos = compiler.stop_token_ids[0]
    logits = torch.zeros(compiler.vocab_size)
    mask_rows(compiler, logits, {0: m})
    assert torch.isinf(logits[eos])
    assert not m.accept(eos)  # refused, matcher unchanged
    for t in tok.encode("ab", add_special_tokens=False):
        assert m.accept(t)
    assert not m.is_terminated()
    logits = torch.zeros(compiler.vocab_size)
    mask_rows(compiler, logits, {0: m})  # complete: the stop tokens alone are allowed
    assert torch.isfinite(logits).sum() == len(compiler.stop_token_ids)
    assert m.accept(eos) and m.is_terminated()


def test_cache_lru_bound_and_hits(tok):
    c = GrammarCompiler(tok, len(tok), cache_size=2)
    specs = [GrammarSpec("regex", f"a{{{n}}}") for n in range(1, 4)]
    first = c.compile(specs[0])
    assert c.compile(specs[0]) is first and c.hits == 1
    second, third = c.compile(specs[1]), c.compile(specs[2])
    assert c.compile(specs[2]) is third and c.compile(specs[1]) is second  # both kept
    assert c.hits == 3 and c.misses == 3
    assert c.compile(specs[0]) is not first  # the bound of 2: evicted, recompiled
    assert c.misses == 4
    assert c.compile(specs[1]) is second and c.compile(specs[2]) is not third  # LRU order
    c.close()


def test_batched_apply_matches_per_row(compiler, tok):
    specs = [GrammarSpec.from_json_schema(SCHEMAS[i]) for i in (0, 5, 9)] + [
        GrammarSpec("regex", "[0-9]+")
    ]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, compiler.vocab_size, generator=g)
    rows = [0, 2, 3, 5]
    batch = logits.clone()
    mask_rows(compiler, batch, {r: new_matcher(compiler, s) for r, s in zip(rows, specs)})
    for r, s in zip(rows, specs):
        single = logits[r].clone()
        mask_rows(compiler, single, {0: new_matcher(compiler, s)})
        assert torch.equal(batch[r], single)
    for r in (1, 4):
        assert torch.equal(batch[r], logits[r])  # rows without a grammar untouched
    assert not torch.equal(batch[0], logits[0])


def test_bf16_logits(compiler):
    m = new_matcher(compiler, GrammarSpec("regex", "[0-9]"))
    logits = torch.zeros(compiler.vocab_size, dtype=torch.bfloat16)
    mask_rows(compiler, logits, {0: m})
    assert torch.isfinite(logits).sum() == 10


_IMPORTS = """
import sys
import mambaradix.engine.engine, mambaradix.server.app
before = "xgrammar.compiler" in sys.modules
from mambaradix.engine.grammar import validate_spec, xgr
from mambaradix.core import GrammarSpec
try:
    validate_spec(GrammarSpec("regex", "a("), "regex")
except ValueError as e:
    print("refused:", "regex" in str(e))
print(before, "xgrammar.compiler" in sys.modules, type(xgr.Grammar.from_regex("a+")).__name__)
"""


def test_xgrammar_is_imported_by_the_first_grammar_not_by_the_engine():
    """Importing the engine and the server must not import xgrammar (~0.4 s of every start);
    the first use of a grammar does, and behaves as an eager import would."""
    import os
    import subprocess

    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTS],
        check=True, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1"},
    ).stdout.split("\n")  # fmt: skip
    assert out[0] == "refused: True"  # a bad regex is still a ValueError naming the field
    assert out[1] == "False True Grammar"
