"""All-greedy batches whose tokens stay on the device (``ModelRunner.defer_greedy``, on by
default on a GPU): the tokens come back through ``PendingTokens`` when the scheduler processes
the batch, and the next forward reads them on the device (``_write_device_ids``) instead of
waiting for them. Here the same code runs on CPU tensors (the flag set by hand; a CPU event is
nothing to wait for): outputs and logprobs equal the path that reads every token back, with
overlap on and off, the cache on, mixed with rows that cannot defer."""

from __future__ import annotations

import random

import pytest
import torch

from mambaradix.engine import runner as runner_mod
from mambaradix.engine.batch import PendingTokens, RunResult
from mambaradix.engine.engine import Engine
from mambaradix.models.loader import load_model, load_tokenizer
from mambaradix.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_qwen3_5(tmp_path_factory):
    path = make_tiny_checkpoint("qwen3_5", str(tmp_path_factory.mktemp("qwen3_5_defer")))
    return load_model(path), load_tokenizer(path)


def _workload(vocab: int) -> tuple[list[list[int]], list[dict]]:
    """Greedy requests sharing a prefix, one sampled with a seed, one asking for top logprobs
    (neither can defer: batches holding them read every token back)."""
    rng = random.Random(3)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    shared = tok(40)
    prompts = [shared + tok(n) for n in (5, 11, 23)] + [tok(17), tok(9)]
    greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    params = [dict(greedy) for _ in prompts]
    # these two end early: the greedy rows go on in batches of several that defer
    params[3] = dict(greedy, temperature=0.8, top_p=0.9, seed=11, max_new_tokens=4)
    params[4] = dict(greedy, top_logprobs=2, max_new_tokens=6)
    return prompts, params


def _generate(model, tok, defer: bool, overlap: bool, prompts, params, spy=None):
    with Engine(
        model=model, tokenizer=tok, debug_integrity=True, skip_warmup=True,
        disable_overlap_schedule=not overlap, max_total_tokens=1 << 14, max_mamba_cache_size=64,
    ) as eng:  # fmt: skip
        eng.runner.defer_greedy = defer
        out = []
        # one at a time first (all-greedy batches), then all at once (mixed batches)
        for p, sp in zip(prompts[:3], params[:3]):
            out += eng.generate(input_ids=[p], sampling_params=[dict(sp, return_logprob=True)])
        # the next turn of the first conversation hits the cache where that request ended
        follow = prompts[0] + out[0]["output_ids"] + [7, 8, 9]
        out += eng.generate(
            input_ids=[*prompts, follow],
            sampling_params=[dict(sp, return_logprob=True) for sp in [*params, params[0]]],
        )
        eng.check_integrity()
        assert eng.stats().cached_tokens > 0
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in out]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_deferred_tokens_equal_tokens_read_at_once(tiny_qwen3_5, monkeypatch, overlap):
    model, tok = tiny_qwen3_5
    prompts, params = _workload(model.vocab_size)
    want = _generate(model, tok, False, overlap, prompts, params)

    calls = {"pending": 0, "device_ids": 0}
    pending_init = PendingTokens.__init__
    write_ids = runner_mod.ModelRunner._write_device_ids

    def counting_init(self, *a, **k):
        calls["pending"] += 1
        pending_init(self, *a, **k)

    def counting_write(layout, on_device):
        calls["device_ids"] += 1
        write_ids(layout, on_device)

    monkeypatch.setattr(PendingTokens, "__init__", counting_init)
    monkeypatch.setattr(runner_mod.ModelRunner, "_write_device_ids", staticmethod(counting_write))
    got = _generate(model, tok, True, overlap, prompts, params)
    assert got == want  # ids and logprobs, bit for bit: the same sampling math on one device
    assert calls["pending"] > 10
    # with overlap the next decode is built before the scheduler has the tokens: it reads
    # them on the device; without overlap every token is known when the next batch is built
    assert (calls["device_ids"] > 0) == overlap


def test_a_wrong_device_token_changes_the_outputs(tiny_qwen3_5, monkeypatch):
    """Negative control: the next forward's tokens written from the wrong place (zeros)
    change what the model generates, so the equality above is not vacuous."""
    model, tok = tiny_qwen3_5
    prompts, params = _workload(model.vocab_size)
    want = _generate(model, tok, True, True, prompts, params)

    def zeros(layout, on_device):
        rows = torch.tensor([row for row, _, _ in on_device])
        layout.input_ids.index_fill_(0, rows, 0)

    monkeypatch.setattr(runner_mod.ModelRunner, "_write_device_ids", staticmethod(zeros))
    assert _generate(model, tok, True, True, prompts, params) != want


def test_pending_tokens_read_back_once():
    pair = torch.tensor([[5.0, 70001.0], [-0.25, -3.5]], dtype=torch.float64)
    result = RunResult(7, [], [], pending=PendingTokens(pair), seconds=0.5)
    assert result.wait() is result
    assert result.tokens == [5, 70001] and all(type(t) is int for t in result.tokens)
    assert result.logprobs == [-0.25, -3.5]
    assert result.pending is None and result.seconds == 0.5  # no GPU time on a CPU
    result.tokens[0] = 6
    assert result.wait().tokens == [6, 70001]  # read once: a second wait changes nothing
