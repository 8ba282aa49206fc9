"""``--state-eviction-policy`` at the engine: chat sessions of different lengths coming back in
turn to a state pool that holds fewer than all of them (LRU's cyclic worst case). Every output
is checked against the fake model's closed form, so the policy changes what is computed, never
what is answered. Its order within the tree: tests/cache/test_evict_value.py; the hit contract
under both policies: test_hit_contract.py."""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, fake_engine, rand_tokens
from fake_model import expected_greedy

LENGTHS = (64, 128, 256, 512, 1024)


def _sessions_in_turn(policy: str, strategy: str, slots: int, rng, rounds: int = 4):
    """Each round every session sends its history plus 16 new tokens; returns the rounds'
    (history length, cached tokens) per session and the prompt tokens the engine computed."""
    history = [rand_tokens(rng, n) for n in LENGTHS]
    flags = dict(
        state_eviction_policy=policy, max_mamba_cache_size=slots, mamba_scheduler_strategy=strategy
    )
    per_round = []
    with fake_engine(**flags) as eng:
        start = eng.stats().computed_prefill_tokens
        for _ in range(rounds):
            turn = []
            for i, past in enumerate(history):
                prompt = past + rand_tokens(rng, 16)
                params = {**GREEDY, "ignore_eos": True, "return_logprob": True}
                res = eng.generate(input_ids=prompt, sampling_params=params)
                ids, lps = expected_greedy(prompt, len(res["output_ids"]))
                assert res["output_ids"] == ids
                got = res["meta_info"]["output_token_logprobs"]
                assert max(abs(a - b) for a, b in zip(got, lps)) <= 1e-5
                turn.append((len(past), res["meta_info"]["cached_tokens"]))
                history[i] = prompt + res["output_ids"]
                eng.check_integrity()
            per_round.append(turn)
        computed = eng.stats().computed_prefill_tokens - start
    return per_round, computed


@pytest.mark.parametrize("strategy,slots", [("no_buffer", 5), ("extra_buffer", 8)])
def test_value_keeps_the_longest_session_lru_loses_all(strategy, slots, rng):
    """Five sessions (64 to 1,024 tokens of history) in turn, room for the states of about
    two: LRU frees each session's state just before it comes back and hits nothing after the
    first round; ``value`` keeps the longest session, which resumes exactly where it left
    (its whole history but the last token) every round, and computes a third less."""
    lru, lru_computed = _sessions_in_turn("lru", strategy, slots, rng)
    value, value_computed = _sessions_in_turn("value", strategy, slots, rng)
    assert all(hit == 0 for turn in lru for _, hit in turn), lru
    for turn in value[1:]:
        past, hit = turn[-1]
        assert hit == past - 1, value
    assert value_computed < 0.7 * lru_computed
