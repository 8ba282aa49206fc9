"""Speculative decoding's acceptance rules and n-gram drafts (``engine/speculative.py``).

- Greedy acceptance emits exactly the tokens greedy decoding emits, whatever the drafts.
- Sampling: the joint distribution of the first two tokens emitted under speculation (a toy
  target and drafter over 4 tokens, both depending on the prefix) equals the target's own, by a
  chi-square test over 16 cells; negative control: a rule that, on a rejection, draws from the
  target instead of the residual fails the same test. Both for a sampled draft (MTP-like) and
  a deterministic one (n-gram: a point mass).
- A seeded request gives the same tokens on every run.
- N-gram drafts: the most recent earlier occurrence of the longest matching suffix, against a
  brute-force search.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mambaradix.engine.speculative import NgramDrafter, accept_greedy, accept_sampled

V = 4


def _target(prefix: tuple[int, ...]) -> torch.Tensor:
    """A toy target distribution over 4 tokens that depends on the prefix."""
    base = torch.tensor([0.50, 0.25, 0.15, 0.10], dtype=torch.float64)
    return base.roll(sum(prefix) % V)


def _drafter(prefix: tuple[int, ...]) -> torch.Tensor:
    """A drafter that disagrees with the target (it prefers the target's least likely)."""
    base = torch.tensor([0.10, 0.20, 0.30, 0.40], dtype=torch.float64)
    return base.roll(sum(prefix) % V)


def _residual_ignored(draft, target_probs, generator, draft_probs=None):
    """A wrong rule: on a rejection it draws from the target, not the residual."""
    out = []
    for i, x in enumerate(draft):
        p = target_probs[i] / target_probs[i].sum()
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x), V).double()  # fmt: skip
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(q[x]) < float(p[x]):
            out.append(x)
            continue
        out.append(int(torch.multinomial(p, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft)], 1, generator=generator)))
    return out


def _first_two(seed: int, k: int, sampled_draft: bool, rule=accept_sampled) -> tuple[int, int]:
    """Speculative steps until two tokens are out: drafts of ``k`` tokens (drawn from the
    drafter, or its most likely token when ``sampled_draft`` is False), verified by ``rule``."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < 2:
        prefix = tuple(out)
        draft, qs = [], []
        for _ in range(k):
            q = _drafter(prefix + tuple(draft))
            x = int(torch.multinomial(q, 1, generator=gen)) if sampled_draft else int(q.argmax())
            draft.append(x)
            qs.append(q)
        rows = torch.stack([_target(prefix + tuple(draft[:i])) for i in range(k + 1)])
        out += rule(draft, rows, gen, torch.stack(qs) if sampled_draft else None)
    return out[0], out[1]


def _chi_square(rule, sampled_draft: bool, trials: int = 6000, k: int = 2) -> float:
    counts = torch.zeros(V, V, dtype=torch.float64)
    for seed in range(trials):
        a, b = _first_two(seed, k, sampled_draft, rule)
        counts[a, b] += 1
    expected = torch.stack([_target(())[a] * _target((a,)) for a in range(V)]) * trials
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_LIMIT = 45.0  # 15 degrees of freedom: exceeded with probability ~1e-4 by a right rule


@pytest.mark.parametrize("sampled_draft", [True, False], ids=["sampled", "deterministic"])
def test_sampling_keeps_the_target_distribution(sampled_draft: bool) -> None:
    assert _chi_square(accept_sampled, sampled_draft) < CHI2_LIMIT


@pytest.mark.parametrize("sampled_draft", [True, False], ids=["sampled", "deterministic"])
def test_a_rule_without_the_residual_fails_the_distribution_test(sampled_draft: bool) -> None:
    assert _chi_square(_residual_ignored, sampled_draft) > 4 * CHI2_LIMIT


def test_a_seeded_request_gives_the_same_tokens() -> None:
    runs = [[_first_two(seed, 3, True) for seed in range(50)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 3  # the seeds matter


# --------------------------------------------------------------------------- greedy


def _greedy_next(prefix: tuple[int, ...]) -> int:
    return (sum(prefix) * 7 + len(prefix) * 3) % 11


@given(st.integers(0, 10_000), st.integers(1, 5))
def test_greedy_acceptance_emits_what_greedy_decoding_emits(seed: int, k: int) -> None:
    rng = random.Random(seed)
    want: list[int] = []
    while len(want) < 30:
        want.append(_greedy_next(tuple(want)))
    got: list[int] = []
    while len(got) < 30:
        # drafts right for a while, then wrong (or right all along)
        draft, prefix = [], tuple(got)
        for _ in range(k):
            right = _greedy_next(prefix + tuple(draft))
            draft.append(right if rng.random() < 0.7 else (right + 1) % 11)
        rows = [_greedy_next(prefix + tuple(draft[:i])) for i in range(k + 1)]
        emitted = accept_greedy(draft, rows)
        assert 1 <= len(emitted) <= k + 1
        got += emitted
    assert got[:30] == want


def test_greedy_acceptance_negative_control() -> None:
    """Emitting the draft's token at the first disagreement departs from greedy decoding."""
    draft, rows = [4, 5, 6], [4, 9, 1, 2]
    assert accept_greedy(draft, rows) == [4, 9]
    assert [*draft[:2]] != accept_greedy(draft, rows)


# --------------------------------------------------------------------------- n-gram drafts


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):  # an occurrence ending before the last
            if tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 6))
def test_ngram_drafts_match_a_brute_force_search(tokens: list[int], k: int) -> None:
    drafter = NgramDrafter(min_n=1, max_n=3)
    for i, t in enumerate(tokens):
        drafter.append(t)
        assert drafter.propose(k) == _brute_force(tokens[: i + 1], k, 1, 3)


def test_ngram_draft_of_a_repeating_text() -> None:
    drafter = NgramDrafter([1, 2, 3, 4, 5, 9, 1, 2, 3], min_n=2, max_n=3)
    assert drafter.propose(3) == [4, 5, 9]
    assert NgramDrafter([1, 2, 3], min_n=2, max_n=3).propose(2) == []
    with pytest.raises(ValueError):
        NgramDrafter(min_n=3, max_n=2)
