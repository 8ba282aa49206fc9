"""``--speculative-adaptive``'s step costs kept across restarts (``engine/spec_costs.py``).

- A saved file loads back into the same samples, and a policy started from it picks the cap
  those costs favour at its first step (negative control: started without it, the full draft
  first, as a fresh process must).
- The file is untrusted: malformed JSON, another version or key, out-of-range shapes or
  samples (negative, NaN, bool, too many), a file too large: each is ignored (no shape taken,
  a warning) and never raises.
- An engine writes its costs at shutdown where ``cost_path`` says, a second engine with the same
  settings starts from them, one with another setting (thread count) does not read them,
  ``none`` writes nothing, and an engine whose file is corrupt starts, serves and replaces it.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest
import torch

from mambaradix.config import EngineConfig
from mambaradix.engine import spec_costs
from mambaradix.engine.engine import Engine
from mambaradix.engine.spec_policy import CONFIRM, SAMPLES, AdaptiveDrafts, StepCosts
from mambaradix.models.loader import load_model, load_tokenizer, resolve_model_path

KEY = {"cpu": "test cpu", "threads": 2, "k": 3}


class FakeReq:
    spec_rate = None


def superlinear() -> StepCosts:
    """A machine where every draft row costs more than a step: cap 0 is best."""
    c = StepCosts()
    for rows in (1, 2, 3, 4):
        for _ in range(CONFIRM):
            c.observe(1, rows, 0.1 * rows * rows)
    return c


def test_saved_costs_load_back_and_steer_the_first_step(tmp_path):
    path = tmp_path / "costs.json"
    spec_costs.save(path, KEY, superlinear())
    fresh = AdaptiveDrafts(3)
    assert spec_costs.load(path, KEY, fresh.costs) == 4
    assert fresh.costs.samples() == superlinear().samples()
    assert fresh.costs.confirmed(1, 4)
    assert fresh.choose([FakeReq()], [3], batch=1) == 0  # no draft pays: from the first step
    # negative control: a policy that knows nothing tries the full draft first
    assert AdaptiveDrafts(3).choose([FakeReq()], [3], batch=1) == 3


def test_new_steps_replace_the_loaded_ones(tmp_path):
    """The loaded samples are the oldest: SAMPLES new steps of a shape replace them all."""
    path = tmp_path / "costs.json"
    spec_costs.save(path, KEY, superlinear())
    c = StepCosts()
    spec_costs.load(path, KEY, c)
    for _ in range(SAMPLES):
        c.observe(1, 4, 0.2)
    assert c.estimate(1, 4) == pytest.approx(0.2)


def _doc(**over):
    doc = {"version": 1, "key": KEY, "shapes": [[1, 1, [0.1, 0.1, 0.1]], [1, 2, [0.15]]]}
    doc.update(over)
    return json.dumps(doc)


BAD = {
    "not json": "{version: 1",
    "a list": "[]",
    "another version": _doc(version=2),
    "another key": _doc(key=dict(KEY, threads=1)),
    "no shape list": _doc(shapes={"1": 0.1}),
    "a short entry": _doc(shapes=[[1, 1]]),
    "rows below batch": _doc(shapes=[[4, 2, [0.1]]]),
    "batch zero": _doc(shapes=[[0, 1, [0.1]]]),
    "float batch": _doc(shapes=[[1.0, 1, [0.1]]]),
    "negative time": _doc(shapes=[[1, 1, [-0.1]]]),
    "zero time": _doc(shapes=[[1, 1, [0.0]]]),
    "nan time": _doc(shapes=[[1, 1, [float("nan")]]]),
    "an hour and more": _doc(shapes=[[1, 1, [3601.0]]]),
    "bool time": _doc(shapes=[[1, 1, [True]]]),
    "string time": _doc(shapes=[[1, 1, ["0.1"]]]),
    "too many samples": _doc(shapes=[[1, 1, [0.1] * (SAMPLES + 1)]]),
    "no samples": _doc(shapes=[[1, 1, []]]),
    "too many shapes": _doc(shapes=[[1, r, [0.1]] for r in range(1, spec_costs.MAX_SHAPES + 2)]),
    "too large": _doc(pad="x" * spec_costs.MAX_BYTES),
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_file_is_ignored_with_a_warning(what, tmp_path, caplog):
    path = tmp_path / "costs.json"
    path.write_text(BAD[what])
    c = StepCosts()
    with caplog.at_level(logging.WARNING, logger="mambaradix.engine.spec_costs"):
        assert spec_costs.load(path, KEY, c) == 0
    assert c.samples() == {}
    assert "ignored" in caplog.text


def test_a_sound_file_loads_and_a_missing_one_is_quiet(tmp_path, caplog):
    """The control for the cases above: the same document unbroken loads its two shapes; no
    file at all is a fresh start without a warning."""
    path = tmp_path / "costs.json"
    path.write_text(_doc())
    c = StepCosts()
    with caplog.at_level(logging.WARNING, logger="mambaradix.engine.spec_costs"):
        assert spec_costs.load(path, KEY, c) == 2
        assert spec_costs.load(tmp_path / "absent.json", KEY, StepCosts()) == 0
    assert c.confirmed(1, 1) and not c.confirmed(1, 2)
    assert caplog.text == ""


def test_the_flag_needs_adaptive_speculation():
    with pytest.raises(ValueError, match="needs --speculative-adaptive"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_adaptive_costs="none").validate()


# ------------------------------------------------------------------------------- engine

FLAGS = dict(
    max_total_tokens=1 << 12, max_mamba_cache_size=32, disable_overlap_schedule=True,
    speculative_algorithm="NGRAM", speculative_adaptive=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def lfm2():
    path = resolve_model_path("tiny:lfm2")
    return load_model(path), load_tokenizer(path)


def _serve(model, tok, **flags) -> Engine:
    """An engine that ran a few repetitive requests (so verify steps were timed), shut down."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.vocab_size) for _ in range(5)] * 4 for _ in range(3)]
    p = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    with Engine(model=model, tokenizer=tok, debug_integrity=True, **dict(FLAGS, **flags)) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=[p] * len(prompts))
        assert all(len(o["output_ids"]) == 24 for o in out)
        eng.check_integrity()
    return eng


def _file(eng: Engine):
    key = spec_costs.cost_key(eng.config, eng.model, eng.kernel_backend)
    return spec_costs.cost_path(eng.config.speculative_adaptive_costs, key), key


def test_an_engine_keeps_its_costs_for_the_next_one(lfm2):
    model, tok = lfm2
    first = _serve(model, tok)
    path, key = _file(first)
    assert path.is_file()
    kept = first.scheduler.adaptive.costs.samples()
    assert sum(len(v) for at in kept.values() for _, v in at) >= CONFIRM
    loaded = StepCosts()
    assert spec_costs.load(path, key, loaded) > 0 and loaded.samples() == kept
    # the next engine with the same settings starts from them before it runs a step
    with Engine(model=model, tokenizer=tok, **FLAGS) as second:
        assert second.scheduler.adaptive.costs.samples() == kept
    # another thread count is another machine's costs: not read (nor overwritten)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with Engine(model=model, tokenizer=tok, **FLAGS) as other:
            assert other.scheduler.adaptive.costs.samples() == {}
            assert _file(other)[0] != path
    finally:
        torch.set_num_threads(threads)


def test_none_keeps_nothing_and_a_corrupt_file_is_replaced(lfm2, tmp_path):
    model, tok = lfm2
    eng = _serve(model, tok, speculative_adaptive_costs="none")
    assert _file(eng)[0] is None
    assert not Path(os.environ["MAMBARADIX_SPEC_COSTS"]).exists()  # the default place: unused
    path = tmp_path / "costs.json"
    path.write_bytes(b"\x00\xffnot json")
    eng = _serve(model, tok, speculative_adaptive_costs=str(path))
    assert spec_costs.load(path, _file(eng)[1], StepCosts()) > 0  # rewritten, sound
