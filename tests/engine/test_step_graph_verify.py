"""Speculative verify steps replayed from step graphs (``engine.step_graph``): a verify step is
a decode of several positions (``layout.VerifyReq``: the last token and the drafts, the state
after each written into its own slot), keyed by the positions of each request.

The runner is driven directly through verify steps of 4 positions at advancing positions, each
step keeping a different number of its tokens (the slot holding the state after the kept ones
becomes the working slot, as ``RequestCache.settle_spec`` does, so every step writes its
positions into a different permutation of slots), alone and two requests sharing a cached
prefix (their attention plan has a shared piece), interleaved with one-token decodes. Every
replay is checked against the Python forward of the same layout over the same pools: logits
and every pool bit for bit (``checked_replays``). Negative control: a graph that does not write
a step's position slots in is caught. Then speculation through the engine: the same ids and
logprobs with step graphs on and off, verify steps replayed."""

from __future__ import annotations

import random

import pytest
import torch
from test_step_graph import POOLS, _generate, checked_replays

from mambaradix.core import ForwardBatch, ForwardReq, SamplingParams, StateOps
from mambaradix.engine import step_graph
from mambaradix.engine.batch import RunBatch
from mambaradix.engine.engine import Engine
from mambaradix.layout import VerifyReq

GREEDY = SamplingParams(temperature=0.0)
WIDTH = 4  # positions of each verify step: the last token and 3 drafts
KEEP = [2, 4, 1, 3, 4, 2, 1, 3]  # tokens kept by successive verify steps


class _Driver:
    """Requests stepped through the engine's runner by hand: a prefill, then verify steps (or
    one-token decodes), each keeping some of its tokens."""

    def __init__(self, eng: Engine, prompts: list[list[int]], shared: int = 0) -> None:
        self.eng, self.runner = eng, eng.runner
        self.batch_id = 1 << 20
        self.vocab = eng.model.vocab_size
        self.rng = random.Random(5)
        kv, st = eng.kv_pool, eng.state_pool
        page = kv.page_size
        self.reqs = []
        first_kv = None
        for i, prompt in enumerate(prompts):
            n = -(-(len(prompt) + 8 * WIDTH + 8) // page) * page
            own = kv.alloc(n)
            slots = st.alloc(WIDTH)
            kv_slots = own
            if i and shared:  # the first `shared` tokens' KV slots are the first request's
                kv_slots = torch.cat([first_kv[:shared], own[shared:]])
            first_kv = first_kv if i else own
            self.reqs.append(dict(tokens=list(prompt), kv=kv_slots, work=int(slots[0]),
                                  spec=[int(s) for s in slots[1:]], done=len(prompt)))  # fmt: skip
        self.run(
            [ForwardReq(0, r["tokens"], r["kv"][: r["done"]], r["work"]) for r in self.reqs],
            StateOps(clear=[r["work"] for r in self.reqs]),
        )

    def run(self, reqs: list[ForwardReq], ops: StateOps | None = None, drafts=None) -> None:
        self.batch_id += 1
        n = len(reqs)
        batch = RunBatch(self.batch_id, ForwardBatch(reqs, ops or StateOps()),
                         sample_rows=list(range(n)), params=[GREEDY] * n,
                         generators=[None] * n, logit_states=[None] * n, grammars=[None] * n,
                         drafts=drafts or {})  # fmt: skip
        self.runner.submit(batch).result()

    def verify(self, keep: int) -> None:
        """One verify step of every request, each then keeping ``keep`` of its tokens."""
        reqs, drafts = [], {}
        for i, r in enumerate(self.reqs):
            draft = [self.rng.randrange(3, self.vocab) for _ in range(WIDTH - 1)]
            p = r["done"] - 1  # its last token is fed again with the drafts, as the engine does
            snaps = [(n + 1, slot) for n, slot in enumerate(r["spec"])]
            reqs.append(VerifyReq(p, r["tokens"][-1:] + draft, r["kv"][: p + WIDTH], r["work"],
                                  snaps, all_logits=True))  # fmt: skip
            drafts[i] = draft
        self.run(reqs, drafts=drafts)
        for r, draft in zip(self.reqs, drafts.values()):
            r["tokens"] += draft[: keep - 1]
            r["done"] += keep - 1
            if keep < WIDTH:  # the state after `keep` tokens is in spec slot keep - 1
                r["work"], r["spec"][keep - 1] = r["spec"][keep - 1], r["work"]

    def decode(self) -> None:
        reqs = []
        for r in self.reqs:
            r["tokens"].append(self.rng.randrange(3, self.vocab))
            p = r["done"]
            reqs.append(ForwardReq(p - 1, r["tokens"][-1:], r["kv"][:p], r["work"]))
        self.run(reqs)
        for r in self.reqs:
            r["done"] += 1


def _drive(eng: Engine, shared: bool) -> None:
    vocab = eng.model.vocab_size
    g = torch.Generator().manual_seed(3)
    system = torch.randint(3, vocab, (48,), generator=g).tolist()
    if shared:  # two requests whose first 48 tokens (and KV slots) are the same
        prompts = [system + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (9, 20)]
    else:
        prompts = [system]
    driver = _Driver(eng, prompts, shared=48 if shared else 0)
    for i, keep in enumerate(KEEP):
        driver.verify(keep)
        if i == 3:  # a decode step between verify steps: another shape
            driver.decode()
            driver.decode()


ARCHS = [
    ("qwen3_5", "float32"),  # Gated DeltaNet + gated attention
    ("qwen3_5", "bfloat16"),
    ("granite_hybrid", "float32"),  # Mamba2 (fused decode step) + attention
    ("lfm2", "bfloat16"),  # short conv + attention
    ("olmo_hybrid", "bfloat16"),  # Gated DeltaNet with beta doubled, heads of 24 / 48
]


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared-prefix"])
@pytest.mark.parametrize("arch,dtype", ARCHS)
def test_replayed_verify_steps_equal_the_python_forward(arch, dtype, shared):
    with Engine(model_path=f"tiny:{arch}", dtype=dtype, disable_radix_cache=True, **POOLS) as eng:
        with checked_replays(eng) as checks:
            _drive(eng, shared)
        stats = eng.runner.graphs.stats
    widths = (WIDTH, WIDTH) if shared else (WIDTH,)
    verifies = [c for c in checks if c[0][2] == widths]
    # the verify shape is recorded on its second step in a row and replayed after that
    assert len(verifies) >= len(KEEP) - 4, (stats, [k for k, _, _ in checks])
    if shared:  # the shared prefix is an attention-plan piece of the key, written in per step
        assert all(k[-1] for k, _, _ in verifies), [k for k, _, _ in verifies]
    bad = [(k, logits, pools) for k, logits, pools in checks if not (logits and pools)]
    assert not bad, bad


def test_a_replay_missing_the_position_slots_is_caught():
    """Negative control: a graph that does not write a verify step's position slots replays
    the recorded step's slots (the working slot changes every step here): the pools differ."""
    original = step_graph.write_inputs

    def without_row_slots(recorded, layout):
        keep = None if recorded.decode.row_slots is None else recorded.decode.row_slots.clone()
        original(recorded, layout)
        if keep is not None:
            recorded.decode.row_slots.copy_(keep)

    step_graph.write_inputs = without_row_slots
    try:
        with Engine(model_path="tiny:qwen3_5", disable_radix_cache=True, **POOLS) as eng:
            with checked_replays(eng) as checks:
                _drive(eng, shared=False)
    finally:
        step_graph.write_inputs = original
    verifies = [c for c in checks if c[0][2]]
    assert verifies and not all(pools for _, _, pools in verifies), verifies


def _repeating_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    out = []
    for _ in range(3):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 7))]
        out.append([rng.randrange(3, vocab) for _ in range(5)] + phrase * 5)
    return out


def test_speculation_outputs_equal_with_graphs_on_and_off():
    """NGRAM speculation, one request at a time (verify steps of one shape follow each other):
    the same ids and logprobs with step graphs on and off, and verify steps were replayed."""
    runs, replayed = {}, None
    for off in (True, False):
        flags = dict(speculative_algorithm="NGRAM", speculative_num_steps=3)
        with Engine(model_path="tiny:qwen3_5", debug_integrity=True, disable_decode_graph=off,
                    **POOLS, **flags) as eng:  # fmt: skip
            prompts = _repeating_prompts(eng.model.vocab_size)
            runs[off] = [_generate(eng, [p], [40])[0] for p in prompts]
            eng.check_integrity()
            if not off:
                replayed = [g.key for g in eng.runner.graphs.graphs if g.key[2]]
                verify_ct = eng.stats().spec_verify_ct
    assert verify_ct > 0 and replayed, (verify_ct, replayed)
    for x, y in zip(runs[True], runs[False]):
        assert x["output_ids"] == y["output_ids"]
        lp = "output_token_logprobs"
        assert x["meta_info"][lp] == y["meta_info"][lp]
