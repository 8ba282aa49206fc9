"""The ``cuda`` backend in the engine: outputs equal the reference's (cache on and off, both
strategies, page sizes), and captured decode steps (``engine.cuda_graphs``) equal the eager
forward step by step.

On a GPU the kernels run there and the steps are real CUDA graphs (``bench/gpu_check.sh``).
Here the same Triton kernels run on CPU tensors under the interpreter (tests/triton/
interpreter.py), and a "captured" step is the forward kept as a Python callable over the
static layout: what differs from a GPU is named where it matters: the interpreter runs each
program of a grid one after the other in numpy (no races, no reordered reductions), and a
CPU step is no graph, so what these tests check here is the padding, the static inputs and
the snapshot copies around a replay, not CUDA's capture itself.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from equivalence_helpers import LOGPROB_ATOL, MAX_TIES, compare, run

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardReq, GrammarSpec, SamplingParams
from mambaradix.engine.cuda_graphs import CudaGraphs
from mambaradix.engine.engine import Engine
from mambaradix.kernels.backend import create_backend
from mambaradix.layout import ForwardContext, ForwardLayout, VerifyReq
from mambaradix.models.loader import load_model, load_tokenizer
from mambaradix.models.tiny import make_tiny_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# cache off, then on with each strategy and page size; chunks of 64 (the backend's snapshot
# stride) put snapshots inside and at the end of forwards
CONFIGS = [
    dict(disable_radix_cache=True),
    dict(mamba_scheduler_strategy="no_buffer", page_size=1),
    dict(mamba_scheduler_strategy="extra_buffer", page_size=16),
]
REFERENCE = dict(disable_radix_cache=True, disable_overlap_schedule=True, kernel_backend="torch",
                 skip_warmup=True)  # fmt: skip


@pytest.fixture(scope="module")
def small_qwen3_5(tmp_path_factory):
    """A Qwen3.5 of one Gated DeltaNet and one attention layer, two value heads: fla-core's
    chunked kernels cost the interpreter ~0.6 s per (chunk, head, layer)."""
    folder = str(tmp_path_factory.mktemp("qwen3_5_small"))
    path = make_tiny_checkpoint("qwen3_5", folder, num_hidden_layers=2,
                                linear_num_value_heads=2, linear_num_key_heads=1)  # fmt: skip
    return path, load_tokenizer(path)


def _prompts(vocab: int) -> list[list[int]]:
    """Four requests sharing a 70-token prefix (a chunk of 64, a snapshot there), a repeat,
    and an unrelated one."""
    rng = random.Random(5)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    shared = tok(70)
    prompts = [shared + tok(n) for n in (3, 9, 17, 30)]
    return [*prompts, list(prompts[1]), tok(12)]


def test_engine_outputs_equal_the_reference(small_qwen3_5):
    """Ids and chosen-token logprobs equal the torch reference's on the CPU, cache off and on
    with each strategy; the cache hits."""
    path, tok = small_qwen3_5
    ref_model = load_model(path)
    prompts = _prompts(ref_model.vocab_size)
    ref, _ = run(ref_model, tok, prompts, REFERENCE, max_new_tokens=3)
    _assert_equal_to(ref, load_model(path, device=DEVICE), tok, prompts, CONFIGS, chunk=64)


def _assert_equal_to(ref, model, tok, prompts, configs, chunk: int) -> None:
    """Each config on the cuda backend (prefill chunks of ``chunk``): ids and logprobs equal
    ``ref``'s (the reference's outputs); the cache hits where it is on."""
    for flags in configs:
        flags = dict(flags, kernel_backend="cuda", device=DEVICE, skip_warmup=True,
                     chunked_prefill_size=chunk, disable_overlap_schedule=True)  # fmt: skip
        got, hits = run(model, tok, prompts, flags, max_new_tokens=3)
        ties, worst = compare(ref, got)
        assert ties <= MAX_TIES and worst <= 10 * LOGPROB_ATOL, (flags, ties, worst)
        if not flags.get("disable_radix_cache"):
            assert hits > 0, flags


@pytest.mark.parametrize("chunked", [False, True], ids=["sequential", "chunked"])
def test_a_mamba2_model_equals_the_reference_with_each_prefill_form(tmp_path, monkeypatch,
                                                                    chunked):  # fmt: skip
    """A Granite-4.0-H (Mamba2 and attention layers) on the cuda backend with its Mamba2
    prefill forced to each form: ids and logprobs equal the reference's, cache off and on.
    Prefills of up to 192 tokens span several of the chunked form's chunks of 64, and the
    requests share a 130-token prefix (a snapshot at 128 inside a forward, a hit after it)."""
    from mambaradix.kernels.cuda_backend import CudaBackend
    from mambaradix.kernels.triton import mamba2 as triton_mamba2
    from mambaradix.kernels.triton import mamba2_chunked as triton_chunked

    path = make_tiny_checkpoint("granite_hybrid", str(tmp_path), num_hidden_layers=2,
                                layer_types=["mamba", "attention"])  # fmt: skip
    tok = load_tokenizer(path)
    ref_model = load_model(path)
    rng = random.Random(5)
    shared = [rng.randrange(3, ref_model.vocab_size) for _ in range(130)]
    prompts = [shared + [rng.randrange(3, ref_model.vocab_size) for _ in range(n)]
               for n in (40, 3)]  # fmt: skip
    ref, _ = run(ref_model, tok, prompts, REFERENCE, max_new_tokens=3)
    calls = {"mamba2_prefill": 0, "mamba2_prefill_chunked": 0}

    def counting(form, fn):
        def counted(*args):
            calls[form] += 1
            return fn(*args)

        return counted

    for module, form in ((triton_mamba2, "mamba2_prefill"),
                         (triton_chunked, "mamba2_prefill_chunked")):  # fmt: skip
        monkeypatch.setattr(module, form, counting(form, getattr(module, form)))
    monkeypatch.setattr(CudaBackend, "mamba2_chunked", chunked)
    model = load_model(path, device=DEVICE)
    _assert_equal_to(ref, model, tok, prompts, (CONFIGS[0], CONFIGS[2]), chunk=192)
    used = "mamba2_prefill_chunked" if chunked else "mamba2_prefill"
    assert calls[used] > 0 and sum(calls.values()) == calls[used], calls


@pytest.fixture(scope="module")
def small_granite_moe(tmp_path_factory):
    """A Granite-4.0-H MoE of one Mamba2 and one attention layer, each with routed experts."""
    folder = str(tmp_path_factory.mktemp("granite_moe_small"))
    path = make_tiny_checkpoint("granite_hybrid_moe", folder, num_hidden_layers=2,
                                layer_types=["mamba", "attention"])  # fmt: skip
    return path, load_tokenizer(path)


@pytest.fixture(scope="module")
def small_nemotron_moe(tmp_path_factory):
    """A Nemotron-H of a Mamba2 (two groups), a MoE (plain relu² experts, fp32 routing
    weights, group-limited router) and an attention block."""
    folder = str(tmp_path_factory.mktemp("nemotron_moe_small"))
    path = make_tiny_checkpoint("nemotron_h", folder,
                                layers_block_type=["mamba", "moe", "attention"])  # fmt: skip
    return path, load_tokenizer(path)


@pytest.mark.parametrize("model", ["small_granite_moe", "small_nemotron_moe"])
def test_a_moe_model_equals_the_reference(model, request, monkeypatch):
    """Routed experts on the cuda backend's Triton grouped GEMM (``triton/moe.py``), gated
    (Granite-4.0-H) and plain (Nemotron-H): ids and logprobs equal the reference's, cache off
    and on; decode steps and prefills both take it."""
    from mambaradix.kernels.triton import moe as triton_moe

    path, tok = request.getfixturevalue(model)
    ref_model = load_model(path)
    prompts = _prompts(ref_model.vocab_size)
    ref, _ = run(ref_model, tok, prompts, REFERENCE, max_new_tokens=3)
    sizes = []
    moe_experts = triton_moe.moe_experts

    def counted(x, *args):
        sizes.append(x.shape[0])
        return moe_experts(x, *args)

    monkeypatch.setattr(triton_moe, "moe_experts", counted)
    _assert_equal_to(ref, load_model(path, device=DEVICE), tok, prompts, CONFIGS[:2], chunk=64)
    assert min(sizes) <= 4 and max(sizes) >= 64, sorted(set(sizes))


@pytest.fixture(scope="module")
def small_qwen3_5_mtp(tmp_path_factory):
    """small_qwen3_5's shape with the published MTP head's tensors."""
    folder = str(tmp_path_factory.mktemp("qwen3_5_small_mtp"))
    path = make_tiny_checkpoint("qwen3_5", folder, num_hidden_layers=2, mtp=True,
                                linear_num_value_heads=2, linear_num_key_heads=1)  # fmt: skip
    return path, load_tokenizer(path)


@pytest.mark.parametrize("algorithm, new", [("NGRAM", 16), ("MTP", 6)])
def test_speculation_equals_the_reference_without_it(small_qwen3_5_mtp, algorithm, new):
    """Speculative decoding on the cuda backend: a verify step is a decode of several positions,
    which its decode kernels step one position at a time, keeping the state after each. Greedy
    ids and logprobs equal the torch reference decoding without speculation, cache on with a
    snapshot every 64 tokens (the backend's stride); verify steps ran, and (NGRAM, prompts that
    repeat a phrase) kept drafts. MTP's draft steps run the head's attention on this backend
    too (fewer tokens: the interpreter's time)."""
    path, tok = small_qwen3_5_mtp
    stats = _speculation_equals_the_reference(path, tok, algorithm, new)
    if algorithm == "NGRAM":
        assert stats.spec_accepted_tokens > stats.spec_verify_ct  # some drafts were kept


def test_speculation_on_a_mamba2_model_equals_the_reference_without_it(tmp_path):
    """The same on a Granite-4.0-H (Mamba2 and attention layers): the verify steps run the conv
    and Mamba2 decode kernels over several positions, and the drafts they keep carry those
    positions' states."""
    path = make_tiny_checkpoint("granite_hybrid", str(tmp_path), num_hidden_layers=2,
                                layer_types=["mamba", "attention"])  # fmt: skip
    # prompts whose continuations this checkpoint repeats in part (seeds found by a search)
    stats = _speculation_equals_the_reference(path, load_tokenizer(path), "NGRAM", 16,
                                              seeds=(27, 14, 53), reps=24)  # fmt: skip
    assert stats.spec_accepted_tokens > stats.spec_verify_ct  # some drafts were kept


def _speculation_equals_the_reference(
    path: str, tok, algorithm: str, new: int, seeds: tuple[int, ...] = (1, 2, 3), reps: int = 12
):
    """Greedy ids and logprobs with speculation on the cuda backend against the torch reference
    without it, on prompts that repeat a phrase ``reps`` times (one per seed, then the first
    again: a cache hit, so the first must pass a snapshot at 64 tokens); verify steps ran.
    Returns the engine's stats."""
    ref_model = load_model(path)
    prompts = []
    for seed in seeds:  # phrases whose continuations the checkpoint repeats in part
        rng = random.Random(seed)
        prompts.append([rng.randrange(3, ref_model.vocab_size)
                        for _ in range(rng.randrange(1, 6))] * reps)  # fmt: skip
    ref, _ = run(ref_model, tok, prompts, REFERENCE, max_new_tokens=new)
    model = load_model(path, device=DEVICE, mtp=algorithm == "MTP")
    flags = dict(kernel_backend="cuda", device=DEVICE, skip_warmup=True, chunked_prefill_size=64,
                 disable_overlap_schedule=True, mamba_scheduler_strategy="extra_buffer",
                 page_size=16, mamba_track_interval=64, speculative_algorithm=algorithm,
                 speculative_num_steps=3)  # fmt: skip
    params = dict(temperature=0.0, max_new_tokens=new, ignore_eos=True, return_logprob=True)
    with Engine(model=model, tokenizer=tok, debug_integrity=True, max_total_tokens=1 << 15,
                max_mamba_cache_size=96, **flags) as eng:  # fmt: skip
        got = eng.generate(input_ids=prompts, sampling_params=params)
        got += eng.generate(input_ids=prompts[:1], sampling_params=params)  # a cache hit
        eng.check_integrity()
        stats = eng.stats()
    ties, worst = compare(ref + ref[:1], got)
    assert ties <= MAX_TIES and worst <= 10 * LOGPROB_ATOL, (ties, worst)
    assert stats.spec_verify_ct > 0 and stats.cached_tokens > 0
    return stats


def test_processed_and_constrained_sampling_equals_the_reference(small_qwen3_5):
    """Penalties, ``logit_bias``, ``min_tokens`` and a grammar (a regex) where the logits are
    (on a GPU their masks and counts are moved there, the grammar mask unpacked there): the ids
    equal the torch reference's; the control: without them the ids differ."""
    path, tok = small_qwen3_5
    ref_model = load_model(path)
    prompts = _prompts(ref_model.vocab_size)[:3]
    pattern = r"[a-c]{2,4}-\d{1,3}"
    processed = dict(temperature=0.0, max_new_tokens=5, repetition_penalty=1.3,
                     frequency_penalty=1.5, logit_bias={7: 4.0}, min_tokens=5)  # fmt: skip
    constrained = dict(temperature=0.0, max_new_tokens=8, grammar=GrammarSpec("regex", pattern))
    params = [processed, constrained, dict(processed, temperature=0.7, seed=5)]
    plain = dict(temperature=0.0, max_new_tokens=5)

    def ids(model, flags, sampling):
        with Engine(model=model, tokenizer=tok, debug_integrity=True, **flags) as eng:
            outs = eng.generate(input_ids=prompts, sampling_params=sampling)
            eng.check_integrity()
        return [o["output_ids"] for o in outs]

    want = ids(ref_model, REFERENCE, params)
    got = ids(load_model(path, device=DEVICE), dict(kernel_backend="cuda", device=DEVICE,
              skip_warmup=True, disable_overlap_schedule=True), params)  # fmt: skip
    assert got == want
    assert re.fullmatch(pattern, tok.decode(got[1], skip_special_tokens=True))
    assert ids(ref_model, REFERENCE, [plain, plain, plain]) != want


# --------------------------------------------------------------------------- captured steps


class _Requests:
    """Requests with their own KV slots and state slots, prefilled once, then decoded."""

    def __init__(self, model, lens: list[int], kv: KVPool, st: StatePool, backend) -> None:
        self.model, self.kv, self.st, self.backend = model, kv, st, backend
        self.kv_slots, self.state_slots, self.lens = [], [], list(lens)
        next_kv = 0
        for i in range(len(lens)):
            self.kv_slots.append(torch.arange(next_kv, next_kv + 64))
            next_kv += 64
            self.state_slots.append(i)
        reqs = [ForwardReq(0, [(7 * i + j) % 50 + 3 for j in range(n)], self.kv_slots[i][:n], i)
                for i, n in enumerate(lens)]  # fmt: skip
        self.forward(reqs)

    def forward(self, reqs: list[ForwardReq]) -> torch.Tensor:
        layout = ForwardLayout.build(reqs, DEVICE)
        self.backend.prepare(layout)
        return self.model.forward(ForwardContext(layout, self.kv, self.st))

    def decode_layout(self, which: list[int], snapshots: dict[int, int]) -> ForwardContext:
        reqs = []
        for i in which:
            n = self.lens[i]
            snaps = [(1, snapshots[i])] if i in snapshots else []
            reqs.append(ForwardReq(n, [(5 * n + i) % 50 + 3], self.kv_slots[i][: n + 1],
                                   self.state_slots[i], snaps))  # fmt: skip
        layout = ForwardLayout.build(reqs, DEVICE)
        self.backend.prepare(layout)
        return ForwardContext(layout, self.kv, self.st)


def _pools(kv: KVPool, st: StatePool) -> list[torch.Tensor]:
    return [*kv.k, *kv.v, *st.conv, *(t for t in st.temporal if t is not None)]


def _prefilled(path: str, state_slots: int):
    """The model on the cuda backend, its pools, and four requests (5, 20, 33, 9 tokens)
    prefilled into KV slots of their own and state slots 0-3."""
    model = load_model(path, device=DEVICE)
    kv = KVPool(model.kv_spec, 512, 1, DEVICE, scratch=1)
    st = StatePool(model.state_spec, state_slots, DEVICE, scratch=1)
    backend = create_backend("cuda", DEVICE)
    model.use_backend(backend)
    return model, kv, st, backend, _Requests(model, [5, 20, 33, 9], kv, st, backend)


def _steps(path: str, graphs_factory, skip_pad_reset: bool = False, steps: int = 4):
    """Decode steps of 4, 3 (the same bucket of 4: its last row back to padding), 2 (one with a
    snapshot into slot 6) and 1 requests, each run eagerly and replayed from the same pools;
    yields (step, eager logits, replayed logits, eager pools, replayed pools, pools before)."""
    model, kv, st, backend, reqs = _prefilled(path, state_slots=8)
    graphs = graphs_factory(model, backend, kv, st)
    if skip_pad_reset:
        write = graphs._write_inputs

        def stale(static, layout):  # the rows past the step's keep the last step's values
            n = layout.num_tokens
            rows = (static.input_ids, static.out_kv_slots, static.decode.state_slots,
                    static.decode.seq_lens)  # fmt: skip
            saved = [t[n:].clone() for t in rows]
            write(static, layout)
            for t, v in zip(rows, saved):
                t[n:] = v

        graphs._write_inputs = stale
    plan = [([0, 1, 2, 3], {}), ([0, 1, 2], {}), ([1, 2], {2: 6}), ([0], {})]
    for step, (which, snaps) in enumerate(plan[:steps]):
        before = [t.clone() for t in _pools(kv, st)]
        with torch.inference_mode():
            eager = model.forward(reqs.decode_layout(which, snaps))
            eager_pools = [t.clone() for t in _pools(kv, st)]
            for t, b in zip(_pools(kv, st), before):
                t.copy_(b)
            replayed = graphs.forward(reqs.decode_layout(which, snaps))
        yield step, eager, replayed, eager_pools, [t.clone() for t in _pools(kv, st)], before
        for i in which:
            reqs.lens[i] += 1


def _graphs(model, backend, kv, st) -> CudaGraphs:
    return CudaGraphs(model, backend, kv, st, [1, 2, 4], DEVICE)


@pytest.mark.parametrize("model", ["small_qwen3_5", "small_granite_moe", "small_nemotron_moe"])
def test_captured_decode_steps_equal_eager_step_by_step(model, request):
    """Logits and every pool (outside the scratch rows) equal the eager forward's after each
    step; a batch of 3 replays the graph of 4 with one padding row, whose writes land in the
    scratch slots only; a decode snapshot lands in its slot. The MoE model's routed experts
    (no host sync: every shape comes from the batch's) are inside the captured step."""
    seen = []
    path = request.getfixturevalue(model)[0]
    for step, eager, replayed, eager_pools, pools, _ in _steps(path, _graphs):
        assert replayed is not None and replayed.shape == eager.shape, step
        torch.testing.assert_close(replayed.float(), eager.float(), atol=1e-5, rtol=1e-5)
        for a, b in zip(pools, eager_pools):
            torch.testing.assert_close(a[:-1].float(), b[:-1].float(), atol=1e-5, rtol=1e-5)
        seen.append(step)
    assert seen == [0, 1, 2, 3]


def test_stale_padding_rows_are_caught(small_qwen3_5):
    """Negative control: a replay that leaves the rows past the step as the last step had them
    (request 3's slots in the batch of 3) advances request 3's state behind its back."""
    differs = False
    path = small_qwen3_5[0]
    for step, _, _, eager_pools, pools, _ in _steps(path, _graphs, skip_pad_reset=True, steps=2):
        if step == 1:
            differs = any(not torch.equal(a[:-1], b[:-1]) for a, b in zip(pools, eager_pools))
    assert differs


def _verify_steps(path: str, stale_row_slots: bool = False):
    """Verify steps (decodes of several positions, a snapshot slot after each but the last)
    of 3 requests x 2 positions (the bucket of 4: one padding request of 2 rows; request 2 also
    copies its state after its last position into slot 15), 2 x 2 and 3 x 3, each run eagerly
    and replayed from the same pools; yields (step, eager logits, replayed logits, eager pools,
    replayed pools, the graphs)."""
    model, kv, st, backend, reqs = _prefilled(path, state_slots=16)
    graphs = _graphs(model, backend, kv, st)
    if stale_row_slots:
        write = graphs._write_inputs

        def stale(static, layout):  # each row's slot left as the graph's capture had it
            kept = static.decode.row_slots.clone()
            write(static, layout)
            static.decode.row_slots.copy_(kept)

        graphs._write_inputs = stale
    plan = [([0, 1, 2], 2, {2: 15}), ([0, 1], 2, {}), ([1, 2, 3], 3, {})]
    for step, (which, width, copies) in enumerate(plan):
        free = iter(range(4, 15))
        rows = []
        for i in which:
            n = reqs.lens[i]
            snaps = [(j, next(free)) for j in range(1, width)]
            snaps += [(width, copies[i])] if i in copies else []
            ids = [(3 * n + i + j) % 50 + 3 for j in range(width)]
            rows.append(VerifyReq(n, ids, reqs.kv_slots[i][: n + width], reqs.state_slots[i],
                                  snaps, all_logits=True))  # fmt: skip

        def ctx(rows=rows):
            layout = ForwardLayout.build(rows, DEVICE)
            backend.prepare(layout)
            return ForwardContext(layout, kv, st)

        before = [t.clone() for t in _pools(kv, st)]
        with torch.inference_mode():
            eager = model.forward(ctx())
            eager_pools = [t.clone() for t in _pools(kv, st)]
            for t, b in zip(_pools(kv, st), before):
                t.copy_(b)
            replayed = graphs.forward(ctx())
        yield step, eager, replayed, eager_pools, [t.clone() for t in _pools(kv, st)], graphs
        for i in which:
            reqs.lens[i] += width


def test_captured_verify_steps_equal_eager_step_by_step(small_qwen3_5):
    """A verify step replays a graph of its batch bucket and positions: logits of every row
    and every pool (each position's snapshot slot, the copy after the last) equal the eager
    forward's; the padding request writes the scratch slots only."""
    graphs = None
    for step, eager, replayed, eager_pools, pools, graphs in _verify_steps(  # noqa: B007
        small_qwen3_5[0]
    ):
        assert replayed is not None and replayed.shape == eager.shape, step
        torch.testing.assert_close(replayed.float(), eager.float(), atol=1e-5, rtol=1e-5)
        for a, b in zip(pools, eager_pools):
            torch.testing.assert_close(a[:-1].float(), b[:-1].float(), atol=1e-5, rtol=1e-5)
    assert sorted(g.key[:2] for g in graphs.graphs) == [(2, 2), (4, 2), (4, 3)]
    assert graphs.stats["replayed"] == 3 and graphs.stats["python"] == 0


def test_stale_verify_row_slots_are_caught(small_qwen3_5):
    """Negative control: a replay that keeps the captured rows' slots (the scratch slot's)
    instead of the step's leaves the snapshot slots unwritten."""
    for step, _, _, eager_pools, pools, _ in _verify_steps(small_qwen3_5[0], True):
        assert any(not torch.equal(a[:-1], b[:-1]) for a, b in zip(pools, eager_pools)), step
        break


def test_a_verify_step_that_cannot_be_captured_leaves_decode_steps_captured(small_qwen3_5):
    """A capture that fails (here: the backend refuses to prepare a verify step's static
    layout) makes that kind of step run eagerly (None: the runner runs the model), logged once;
    one-position decode steps are still captured and replayed."""
    model, kv, st, backend, reqs = _prefilled(small_qwen3_5[0], state_slots=16)
    graphs = _graphs(model, backend, kv, st)
    prepare = backend.prepare

    def refuse_verify(layout):
        if layout.decode is not None and layout.decode.multi and layout is not verify.layout:
            raise RuntimeError("not capturable")
        prepare(layout)

    backend.prepare = refuse_verify
    n = reqs.lens[0]
    rows = [VerifyReq(n, [5, 6], reqs.kv_slots[0][: n + 2], 0, [(1, 9)], all_logits=True)]
    verify = ForwardContext(ForwardLayout.build(rows, DEVICE), kv, st)
    with torch.inference_mode():
        assert graphs.forward(verify) is None
        assert graphs.forward(verify) is None  # not tried again
        assert list(graphs.failed) == ["verify steps"]
        assert graphs.forward(reqs.decode_layout([1, 2], {})) is not None
    assert graphs.stats["replayed"] == 1 and graphs.stats["python"] == 2


def test_verify_steps_of_different_widths_run_eagerly(small_qwen3_5):
    """Requests with different numbers of positions in one verify step: no graph key."""
    model = load_model(small_qwen3_5[0], device=DEVICE)
    kv = KVPool(model.kv_spec, 64, 1, DEVICE, scratch=1)
    st = StatePool(model.state_spec, 8, DEVICE, scratch=1)
    graphs = _graphs(model, create_backend("cuda", DEVICE), kv, st)
    slots = torch.arange(20)
    rows = [VerifyReq(3, [5, 6], slots[:5], 0, [(1, 4)], all_logits=True),
            VerifyReq(3, [5, 6, 7], slots[:6], 1, [(1, 5), (2, 6)], all_logits=True)]  # fmt: skip
    assert graphs.key(ForwardLayout.build(rows, DEVICE)) is None
    assert graphs.key(ForwardLayout.build(rows[:1], DEVICE))[:2] == (1, 2)


def test_disable_cuda_graph_turns_off_the_cpu_step_graphs_too():
    """SGLang's flag is not ignored on a CPU device: it disables the recorded decode steps."""
    with Engine(model_path="tiny:qwen3_next", skip_warmup=True) as on:
        assert on.runner.graphs is not None
    with Engine(model_path="tiny:qwen3_next", skip_warmup=True, disable_cuda_graph=True) as off:
        assert off.runner.graphs is None


@pytest.mark.skipif(DEVICE != "cuda", reason="host-device syncs exist on a GPU only")
def test_a_greedy_decode_step_waits_on_the_gpu_once_at_most(small_qwen3_5):
    """With overlap, a greedy decode step waits on the GPU only for its tokens (the event the
    scheduler reads them by: ``engine.batch.PendingTokens``): the next forward's layout, state
    operations and placeholder tokens reach the device without waiting (``layout.to_device``,
    ``ModelRunner._write_device_ids``). Before those, every index tensor of a step was a
    blocking copy (a sync each). Counted by torch's sync debug mode, as bench_gpu.py does."""
    import warnings

    path, tok = small_qwen3_5
    model = load_model(path, device=DEVICE)
    with Engine(model=model, tokenizer=tok, kernel_backend="cuda", device=DEVICE) as eng:
        assert eng.runner.defer_greedy
        p = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
        eng.generate(input_ids=[list(range(5, 40))], sampling_params=p)  # compiled, captured
        p = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)
        handle = eng.submit_many([list(range(7, 42))], [p])[0]
        steps, first = 0, True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for out in handle.events():
                    if first and out.new_token_ids:  # the prefill's token: decodes from here
                        torch.cuda.set_sync_debug_mode("warn")
                        first = False
                        continue
                    steps += len(out.new_token_ids)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        assert steps == 8 and syncs <= steps, (steps, syncs)
