"""Grammar masks at the vocabulary sizes of real models (the rest of the grammar tests run a
512-token vocabulary, which takes xgrammar's kernel: up to 16,384 tokens ``apply_bitmask_rows``
hands a mask to it; past that, the path every real model takes, it runs its own numpy word
skipping).

- ``apply_bitmask_rows`` at 151,936 logit columns against a reference mask application
  (``masked_fill`` of every bit of the bitmask), fp32 and bf16 logits: masks mostly allowed,
  mostly refused, mixed bit by bit, bits past the vocabulary, logits wider than the vocabulary,
  rows mapped to other bitmask rows and rows left alone;
- a synthetic byte-level tokenizer of 151,643 tokens with the logits padded to 151,936 rows (as
  Qwen's checkpoints are): JSON schemas, a regex, EBNF and a forced tool call driven by random
  logits under the mask, fp32 and bf16 logits, every step's mask equal to the reference's, the
  padded rows refused, the output valid;
- end to end through the engine on a tiny model whose embedding and LM head have those 151,936
  rows, the padded rows' logits made the largest: a json_schema, a regex and a forced tool call
  give valid output (the model's logits are fp32 at any weight dtype; bf16 logits are the
  matcher's, above).

A mask made permissive in the numpy path fails every mask test here (the other grammar tests
pass with it: their 512-token vocabulary never takes that path)."""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from mambaradix.core import SamplingParams
from mambaradix.engine.engine import Engine
from mambaradix.engine.grammar import (
    _SMALL_VOCAB,
    GrammarCompiler,
    GrammarMatcher,
    GrammarSpec,
    _apply_bitmask_rows_on_device,
    apply_bitmask_rows,
)
from mambaradix.engine.structured import BatchMasks
from mambaradix.models.tiny import SPECIAL_TOKENS, make_tiny_checkpoint
from mambaradix.server.tools import get_tool_parser
from mambaradix.server.tools.constrain import call_grammar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grammar_schemas import SCHEMAS  # noqa: E402

TOKENS = 151_643  # Qwen2.5 / Qwen3's tokenizer
ROWS = 151_936  # their embedding and LM head rows (padded)
DTYPES = [torch.float32, torch.bfloat16]
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 12},
        "limit": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "tags", "ok"],
    "additionalProperties": False,
}


def test_the_vocabularies_here_take_the_numpy_path():
    assert TOKENS > _SMALL_VOCAB


# --------------------------------------------------------------------------- the mask itself


def reference_mask(
    logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, rows: dict[int, int]
) -> torch.Tensor:
    """``logits`` with every token whose bit is clear (and every column past ``vocab_size``)
    set to -inf in each row ``r`` of ``rows`` by bitmask row ``rows[r]``, bit by bit."""
    out = logits.clone()
    bits = (bitmask.long()[:, :, None] >> torch.arange(32)) & 1  # little-endian, as xgrammar
    allowed = bits.flatten(1).bool()
    for r, k in rows.items():
        keep = torch.zeros(out.shape[-1], dtype=torch.bool)
        keep[:vocab_size] = allowed[k, :vocab_size]
        out[r].masked_fill_(~keep, float("-inf"))
    return out


def _bitmask(kind: str, words: int, g: torch.Generator) -> torch.Tensor:
    """One bitmask row (int32 words): ``mostly_allowed`` (whole words allowed, a few with
    refused bits), ``mostly_refused`` (a few allowed tokens), ``mixed`` (every bit random),
    ``none`` (nothing allowed) or ``all``."""
    if kind == "all":
        return torch.full((words,), -1, dtype=torch.int32)
    if kind == "none":
        return torch.zeros(words, dtype=torch.int32)
    if kind == "mixed":
        return torch.randint(-(2**31), 2**31, (words,), generator=g, dtype=torch.int64).int()
    row = torch.full((words,), -1 if kind == "mostly_allowed" else 0, dtype=torch.int32)
    at = torch.randperm(words, generator=g)[: words // 20]
    bits = torch.randint(0, 32, (at.numel(),), generator=g)
    flip = torch.ones(at.numel(), dtype=torch.int64).bitwise_left_shift(bits).int()
    row[at] = row[at] ^ flip
    row[-1] = row[-1] ^ (1 << 31)  # past the vocabulary where it is not a multiple of 32
    return row


KINDS = ["mostly_allowed", "mostly_refused", "mixed", "none", "all"]


@pytest.mark.parametrize("apply", [apply_bitmask_rows, _apply_bitmask_rows_on_device],
                         ids=["cpu", "device"])  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab_size", [ROWS, TOKENS], ids=["vocab=rows", "vocab<rows"])
def test_apply_bitmask_rows_equals_the_reference(apply, dtype, vocab_size):
    """Six logit rows of 151,936 columns; rows 0-4 masked by bitmask rows in another order
    (one kind each), row 5 left alone. ``vocab < rows``: the columns past the grammar's
    vocabulary are refused whatever the bitmask's last word says. ``device``: the path logits
    on a GPU take (torch ops only), run here on CPU tensors."""
    g = torch.Generator().manual_seed(vocab_size)
    words = -(-vocab_size // 32)
    bitmask = torch.stack([_bitmask(kind, words, g) for kind in KINDS])
    logits = (torch.randn(6, ROWS, generator=g) * 4).to(dtype)
    rows = {0: 2, 1: 0, 2: 4, 3: 1, 4: 3}
    want = reference_mask(logits, bitmask, vocab_size, rows)
    got = logits.clone()
    apply(got, bitmask, vocab_size, rows)
    assert got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(got[5], logits[5])
    # the masks are what their kinds say (mixed, mostly allowed, all, mostly refused, none)
    finite = [n / vocab_size for n in torch.isfinite(got[:5]).sum(1).tolist()]
    assert 0.45 < finite[0] < 0.55 and 0.95 < finite[1] < 1 and finite[2] == 1, finite
    assert 0 < finite[3] < 0.01 and finite[4] == 0, finite


# --------------------------------------------------------------------------- the matchers


def large_tokenizer(tokens: int, seed: int = 0):
    """A byte-level BPE tokenizer of exactly ``tokens`` tokens: the ChatML specials (ids 0-2),
    the 256 byte symbols, every pair of printable ASCII characters and seeded triples of them
    (text-like tokens, as most of a real vocabulary is), the merged ones in a seeded order (so a
    32-token word of the mask holds tokens of every kind)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # printable ASCII as byte-level symbols (the space is 'Ġ')
    printable = [ch for ch in alphabet if 0x21 <= ord(ch) <= 0x7E] + [chr(0x120)]
    merges = [(a, b) for a in printable for b in printable]
    pairs = [a + b for a, b in merges]
    seen = set(pairs)
    while len(SPECIAL_TOKENS) + len(alphabet) + len(merges) < tokens:
        a, b = rng.choice(pairs), rng.choice(printable)
        if a + b not in seen:
            seen.add(a + b)
            merges.append((a, b))
    merged = [a + b for a, b in merges]
    rng.shuffle(merged)
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *alphabet, *merged])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


@pytest.fixture(scope="module")
def tok():
    return large_tokenizer(TOKENS)


@pytest.fixture(scope="module")
def compiler(tok):
    assert len(tok) == TOKENS
    c = GrammarCompiler(tok, ROWS, cache_size=16)
    yield c
    c.close()


def drive(compiler, spec, tok, seed: int, dtype, max_steps: int = 300) -> str:
    """Greedy argmax of seeded random logits (``dtype``) under the mask until the grammar
    terminates, each step's mask checked against the reference; the text without the stop."""
    matcher = GrammarMatcher(compiler.compile(spec), compiler.vocab_size)
    g = torch.Generator().manual_seed(seed)
    bitmask = compiler.allocate_bitmask(1)
    out: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, ROWS, generator=g).to(dtype)
        masks = BatchMasks(compiler, [(0, matcher)], bitmask, None)  # the engine's path
        want = reference_mask(logits, bitmask, ROWS, {0: 0})
        masks.apply(logits)
        assert torch.equal(logits, want)
        assert torch.isinf(logits[0, TOKENS:]).all(), "the padded rows must be refused"
        t = int(logits.argmax())
        assert matcher.accept(t)
        if matcher.is_terminated():
            assert t in compiler.stop_token_ids
            return tok.decode(out)
        out.append(t)
    pytest.fail(f"grammar did not terminate within {max_steps} steps: {tok.decode(out)!r}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_json_schemas(compiler, tok, dtype):
    for i in (0, 5, 6, 9, 13, 17):
        schema = SCHEMAS[i]
        text = drive(compiler, GrammarSpec.from_json_schema(schema), tok, seed=i, dtype=dtype)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_regex_ebnf_and_a_forced_tool_call(compiler, tok, dtype):
    pattern = r"[a-c]{2,4}-\d{1,3}(x|yz)?"
    assert re.fullmatch(pattern, drive(compiler, GrammarSpec("regex", pattern), tok, 1, dtype))
    ebnf = 'root ::= "(" expr ")"\nexpr ::= num | num "+" num\nnum ::= [1-9] [0-9]?\n'
    text = drive(compiler, GrammarSpec("ebnf", ebnf), tok, 2, dtype)
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)?\)", text), text
    spec = call_grammar("qwen", {"search": SEARCH}, "search")
    _assert_one_search_call(drive(compiler, spec, tok, 3, dtype))


def _assert_one_search_call(text: str) -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
    _, calls = get_tool_parser("qwen").parse(text, tools)
    assert len(calls) == 1 and calls[0].name == "search", text
    jsonschema.validate(json.loads(calls[0].arguments), SEARCH)


def test_batched_masks_equal_the_reference(compiler, tok):
    """The engine's masks (``BatchMasks``) over a batch of matchers at several states (an
    object's first key, a JSON string's inside, digits only), rows without a grammar untouched."""
    specs = [GrammarSpec.from_json_schema(SCHEMAS[i]) for i in (0, 9)]
    specs += [GrammarSpec("regex", "[0-9]+"), GrammarSpec.from_json_schema({"type": "string"})]
    matchers = [GrammarMatcher(compiler.compile(s), compiler.vocab_size) for s in specs]
    for m, prefix in zip(matchers, ['{"a":"', "", "", '"ab']):
        for t in tok.encode(prefix, add_special_tokens=False):
            assert m.accept(t)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, ROWS, generator=g)
    rows = [0, 2, 3, 5]
    masks = BatchMasks(compiler, list(zip(rows, matchers)), compiler.allocate_bitmask(4), None)
    got = logits.clone()
    masks.apply(got)
    want = reference_mask(logits, masks.bitmask, ROWS, {r: k for k, r in enumerate(rows)})
    assert torch.equal(got, want)
    finite = torch.isfinite(got).sum(1).tolist()
    assert finite[1] == finite[4] == ROWS  # rows without a grammar untouched
    assert finite[0] > 0.8 * TOKENS and finite[5] > 0.8 * TOKENS, finite  # inside strings
    assert 0 < finite[2] < 0.01 * TOKENS and 0 < finite[3] < 0.01 * TOKENS, finite


# --------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory, tok) -> str:
    """A tiny Qwen3.5 (hidden 64) whose embedding and LM head have ``ROWS`` rows for the
    ``TOKENS``-token tokenizer; the padded rows of the LM head are ten times the others, so
    that unmasked their logits are the largest (the padded tokens win every step)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp("padded_vocab"))
    make_tiny_checkpoint("qwen3_5", folder)
    config = AutoConfig.from_pretrained(folder)
    config.vocab_size = ROWS
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight[TOKENS:] *= 10
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def eng(padded_model):
    e = Engine(model_path=padded_model, skip_warmup=True, debug_integrity=True,
               max_total_tokens=4096, max_mamba_cache_size=16)  # fmt: skip
    assert e.model.vocab_size == ROWS and len(e.tokenizer) == TOKENS
    yield e
    e.shutdown()


def test_engine_json_schema_regex_and_a_tool_call(eng):
    """Greedy, together in one batch: each request's output is what its grammar allows."""
    specs = [
        GrammarSpec.from_json_schema(RECORD),
        GrammarSpec("regex", r"[a-z]{3,6}-[0-9]{2}"),
        call_grammar("qwen", {"search": SEARCH}, "search"),
    ]
    params = [SamplingParams(grammar=s, max_new_tokens=120, temperature=0.0) for s in specs]
    prompts = [eng.tokenizer.encode(p) for p in ("Give me JSON:", "A code", "Search for it")]
    outs = [h.result() for h in eng.submit_many(prompts, params)]
    eng.check_integrity()
    assert [o["meta_info"]["finish_reason"] for o in outs] == ["stop"] * 3, outs
    assert all(t < TOKENS for o in outs for t in o["output_ids"])
    jsonschema.validate(json.loads(outs[0]["text"]), RECORD)
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", outs[1]["text"]), outs[1]["text"]
    _assert_one_search_call(outs[2]["text"])


def test_engine_without_a_grammar_picks_the_padded_rows(eng):
    """The control: unmasked, the padded rows win (so the test above sees the mask)."""
    ids = eng.tokenizer.encode("Give me JSON:")
    out = eng.submit(ids, SamplingParams(max_new_tokens=4, temperature=0.0)).result()
    assert all(t >= TOKENS for t in out["output_ids"]), out["output_ids"]
