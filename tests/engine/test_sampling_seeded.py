"""Seeded sampling: a seed fixes the sample whatever else is in the batch, different seeds
give different samples, and the samples follow softmax(logits / temperature), so a sampler
that ignores its seed or degenerates to greedy fails here."""

from __future__ import annotations

import math
import random

import pytest
import torch
from engine_helpers import fake_engine, rand_tokens
from fake_model import State, advance, logit_row, v_entries

TEMPERATURE = 5.0  # the fake model's logits are 10 / 5 / 0: at T=5 every token is likely


def first_token_probs(prompt: list[int], temperature: float) -> torch.Tensor:
    state: State = (0, 0, 0, 0)
    sums = [0, 0]
    for pos, t in enumerate(prompt):
        state = advance(state, t)
        v0, v1 = v_entries(pos, t)
        sums[0] += v0
        sums[1] += v1
    return torch.softmax(logit_row(state, (sums[0], sums[1])).double() / temperature, -1)


def test_same_seed_same_sample_different_seeds_differ_and_not_greedy():
    rng = random.Random(5)
    prompt = rand_tokens(rng, 40)
    params = dict(temperature=TEMPERATURE, max_new_tokens=12, ignore_eos=True)
    with fake_engine() as eng:
        greedy = eng.generate(input_ids=prompt, sampling_params={**params, "temperature": 0.0})
        alone = eng.generate(input_ids=prompt, sampling_params={**params, "seed": 7})
        # the same seeded request again, now batched with others (other rows, other seeds)
        batch = eng.generate(
            input_ids=[prompt] * 6,
            sampling_params=[{**params, "seed": s} for s in (1, 2, 7, 3, 4, 5)],
        )
        top1 = eng.generate(input_ids=prompt, sampling_params={**params, "seed": 9, "top_k": 1})
    assert batch[2]["output_ids"] == alone["output_ids"]
    samples = [tuple(b["output_ids"]) for b in batch]
    assert len(set(samples)) >= 5, "different seeds gave the same samples"
    assert all(list(s) != greedy["output_ids"] for s in samples), "sampling looks greedy"
    assert top1["output_ids"] == greedy["output_ids"], "top_k=1 must be greedy"


def test_samples_follow_the_tempered_distribution():
    rng = random.Random(6)
    prompt = rand_tokens(rng, 30)
    n = 400
    probs = first_token_probs(prompt, TEMPERATURE)
    params = [dict(temperature=TEMPERATURE, max_new_tokens=1, seed=s) for s in range(n)]
    with fake_engine() as eng:
        out = eng.generate(input_ids=[prompt] * n, sampling_params=params)
    counts = torch.bincount(torch.tensor([o["output_ids"][0] for o in out]), minlength=61)
    top = int(torch.argmax(probs))
    p = float(probs[top])
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(int(counts[top]) - n * p) < 4 * sigma, (int(counts[top]), n * p)
    # the rest of the mass is spread: most tokens appear, none dominates like the top one
    assert int((counts > 0).sum()) >= 40
    # a sampler at temperature 1 would give the top token ~99% of the time: far outside
    p1 = float(first_token_probs(prompt, 1.0)[top])
    assert abs(n * p1 - n * p) > 8 * sigma


def test_a_sampler_that_ignores_its_seed_fails_the_check(monkeypatch):
    """Negative control: with the per-request generator dropped, the same seed no longer
    gives the same sample across batches."""
    from mambaradix.engine import sampler

    original = sampler._sample_row
    monkeypatch.setattr(sampler, "_sample_row", lambda row, p, gen: original(row, p, None))
    rng = random.Random(5)
    prompt = rand_tokens(rng, 40)
    params = dict(temperature=TEMPERATURE, max_new_tokens=12, ignore_eos=True, seed=7)
    with fake_engine() as eng:
        runs = [eng.generate(input_ids=prompt, sampling_params=params) for _ in range(3)]
    assert len({tuple(r["output_ids"]) for r in runs}) > 1


def test_engine_seed_makes_unseeded_sampling_repeatable():
    """``--seed``: requests without a seed of their own draw one from the engine's seed in
    arrival order, so two engines with the same ``seed`` sample the same tokens, and another
    ``seed`` samples others. Seeds near the top of the range must not overflow."""
    rng = random.Random(8)
    prompt = rand_tokens(rng, 30)
    params = dict(temperature=TEMPERATURE, max_new_tokens=12, ignore_eos=True)

    def run(seed: int) -> list[tuple[int, ...]]:
        with fake_engine(seed=seed) as eng:
            outs = [eng.generate(input_ids=prompt, sampling_params=params) for _ in range(4)]
        return [tuple(o["output_ids"]) for o in outs]

    first, again, other = run(3), run(3), run(4)
    assert first == again
    assert len(set(first)) > 1, "unseeded requests of one engine drew the same seed"
    assert first != other


class _ElsewhereGenerator(torch.Generator):
    """A CPU generator that says it draws on another device ("cpu:0" is not "cpu"): the case
    of a request's seeded CPU generator beside logits on a GPU, on this machine."""

    @property
    def device(self) -> torch.device:
        return torch.device("cpu", 0)


def test_rows_drawn_elsewhere_are_moved_in_one_copy_and_sample_the_same():
    """``sample`` moves the sampled rows whose generators draw on another device in one copy
    (one read of a GPU per batch, not per row); the tokens and logprobs equal those of the same
    seeds drawing row by row where the logits are."""
    from mambaradix.core import SamplingParams
    from mambaradix.engine import sampler

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [SamplingParams(temperature=t, top_p=0.95) for t in (0.0, 1.5, 1.5, 0.0, 2.0, 1.0)]

    def gens(kind):
        return [kind().manual_seed(100 + i) for i in range(len(params))]

    moved = sampler._rows_where_drawn(logits, params, gens(_ElsewhereGenerator))
    assert sorted(moved) == [1, 2, 4, 5]  # the sampled rows only
    assert all(torch.equal(row, logits[i]) for i, row in moved.items())
    assert sampler._rows_where_drawn(logits, params, gens(torch.Generator)) == {}
    want = sampler.sample(logits, params, gens(torch.Generator))
    got = sampler.sample(logits, params, gens(_ElsewhereGenerator))
    assert got == want


def test_processed_rows_are_sampled_with_the_others_and_accept_their_own_token():
    """Rows with logits processing (here a logit bias) are processed before any row is drawn:
    a processed greedy row's token is its processed row's argmax (not the raw one), a processed
    sampled row draws from its processed row, moved with the others in one copy, and each
    state accepts its own row's token."""
    from mambaradix.core import SamplingParams
    from mambaradix.engine import sampler
    from mambaradix.engine.logits_process import RequestLogits

    torch.manual_seed(1)
    logits = torch.randn(5, 40) * 3
    raw_best = logits.argmax(-1).tolist()
    forced = [(b + 7) % 40 for b in raw_best]  # a token each row's raw argmax is not
    temps = (0.0, 1.0, 0.0, 1.5, 1.0)
    processed = {0, 1, 3}
    params = [
        SamplingParams(temperature=t, logit_bias={forced[i]: 100.0} if i in processed else {})
        for i, t in enumerate(temps)
    ]

    def run(kind):
        states = [
            RequestLogits(p, [1, 2], 40, [39]) if i in processed else None
            for i, p in enumerate(params)
        ]
        gens = [kind().manual_seed(7 + i) for i in range(len(params))]
        return sampler.sample(logits, params, gens, states), states

    (tokens, lps, _), states = run(torch.Generator)
    assert tokens[0] == forced[0] and tokens[2] == raw_best[2]
    assert tokens[1] == forced[1] and tokens[3] == forced[3]  # drawn from the processed rows
    assert [s.num_outputs for s in states if s is not None] == [1, 1, 1]
    assert lps[0] == pytest.approx(torch.log_softmax(logits[0], -1)[forced[0]].item())
    (moved_tokens, moved_lps, _), _ = run(_ElsewhereGenerator)
    assert (moved_tokens, moved_lps) == (tokens, lps)
