"""Decode step graphs (``engine.step_graph``): a replayed decode step computes exactly what the
model's Python forward computes, for every model family, dtype and shape the engine meets.

The strongest check replays every step twice over: each replay is followed by the Python
forward of the same layout over the pools as they were before it, and the logits and every
pool (KV, conv and temporal states) must be bit-identical. Then whole engine runs with graphs
on and off must give the same ids and logprobs (cache on and off, both strategies, requests
joining and leaving, sequences crossing a table-capacity boundary, sampling with seeds).
Negative controls: a graph that skips one per-step input, or a replay that drops a native
call, is caught by the same checks; recordings that cannot be replayed are refused."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mambaradix.engine import step_graph
from mambaradix.engine.engine import Engine
from mambaradix.layout import ForwardContext
from mambaradix.models.published import cut_fields, get_published
from mambaradix.models.tiny import make_tiny_checkpoint

POOLS = dict(max_total_tokens=4096, max_mamba_cache_size=48)
# Dense Nemotron-H (Mamba2 / attention / MLP blocks, no MoE: replayable), at tiny widths with
# the first layers of each published pattern (every kind kept): Nemotron-H-8B's "M-M-M-M*-",
# Nano-9B-v2's "M-M-M-MM-M-M-M*-" (two Mamba2 blocks in a row) with its Mamba2 head dim of 80
DENSE_NEMOTRON_H = {
    "nemotron_h_8b": dict(layers=9),
    "nemotron_nano_9b_v2": dict(layers=16, mamba_head_dim=80),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """``arch -> model path``: ``tiny:<arch>``, or a dense Nemotron-H checkpoint built once."""
    built: dict[str, str] = {}

    def path(arch: str) -> str:
        if arch not in DENSE_NEMOTRON_H:
            return f"tiny:{arch}"
        if arch not in built:
            extra = dict(DENSE_NEMOTRON_H[arch])
            fields = cut_fields(get_published(arch), layers=extra.pop("layers"))
            kinds = fields["layers_block_type"]
            assert set(kinds) == {"mamba", "attention", "mlp"}, kinds
            folder = str(tmp_path_factory.mktemp(arch))
            built[arch] = make_tiny_checkpoint(
                "nemotron_h", folder, layers_block_type=kinds, **extra
            )
        return built[arch]

    return path


def _pool_tensors(eng: Engine) -> list[torch.Tensor]:
    out = []
    for pool in (eng.kv_pool, eng.state_pool):
        for name in ("k", "v", "conv", "temporal"):
            out += [t for t in getattr(pool, name, None) or () if t is not None]
    return out


@contextlib.contextmanager
def checked_replays(eng: Engine):
    """Every replay checked against the Python forward of the same layout over the same pools
    (bit-identical logits and pools). Yields the list of checks made: (key, same logits,
    same pools)."""
    checks: list[tuple[tuple, bool, bool]] = []
    original = step_graph.StepGraph.replay

    def replay(self, layout, backend):
        pools = _pool_tensors(eng)
        before = [t.clone() for t in pools]
        logits = original(self, layout, backend).clone()
        replayed = [t.clone() for t in pools]
        for t, b in zip(pools, before):
            t.copy_(b)
        eng.backend.prepare(layout)
        want = eng.model.forward(ForwardContext(layout, eng.kv_pool, eng.state_pool))
        same_pools = all(torch.equal(a, t) for a, t in zip(replayed, pools))
        checks.append((self.key, torch.equal(logits, want), same_pools))
        return want

    step_graph.StepGraph.replay = replay
    try:
        yield checks
    finally:
        step_graph.StepGraph.replay = original


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(eng: Engine, prompts, new_tokens: list[int], **params):
    p = dict(dict(temperature=0.0, ignore_eos=True, return_logprob=True), **params)
    return eng.generate(
        input_ids=prompts, sampling_params=[dict(p, max_new_tokens=n) for n in new_tokens]
    )


@pytest.mark.parametrize(
    "arch,dtype",
    [
        ("granite_hybrid", "float32"),
        ("granite_hybrid", "bfloat16"),
        ("lfm2", "bfloat16"),
        ("lfm2_moe", "bfloat16"),  # sigmoid routing with an fp32 expert bias
        ("falcon_h1", "bfloat16"),  # attention and Mamba2 in every layer, no mixer norm
        ("olmo_hybrid", "bfloat16"),  # Gated DeltaNet heads of 24 / 48, beta doubled
        ("qwen3_5", "float32"),
        ("qwen3_5", "bfloat16"),
        ("nemotron_h_8b", "float32"),
        ("nemotron_h_8b", "bfloat16"),
        ("nemotron_nano_9b_v2", "bfloat16"),
        ("granite_hybrid_moe", "bfloat16"),  # MoE: the routed experts in one C call
        ("nemotron_h", "bfloat16"),  # MoE of plain relu² experts, fp32 routing weights
        ("qwen3_next", "bfloat16"),
    ],
)
def test_every_replay_equals_the_python_forward(model_path, arch, dtype):
    """Requests of different lengths finishing at different times (batch 3, 2, 1), one crossing
    the 256-column table capacity: every replayed step's logits and pools equal the Python
    forward's bit for bit, and graphs were recorded for each batch size and capacity."""
    _check_replays(model_path(arch), dtype)


@pytest.mark.parametrize(
    "arch,call",
    [("qwen3_5", "linear_fp8"), ("granite_hybrid", "linear_fp8"),
     ("granite_hybrid_moe", "moe_experts_fp8")],  # fmt: skip (widths of 32: masked chunks)
)
def test_replays_with_fp8_weights_equal_the_python_forward(arch, call):
    """``--quantization fp8``: the fp8 linears' and routed experts' C calls (codes, scales,
    tables) replay as the rest do."""
    from mambaradix.kernels import fp8

    native = fp8._native() is not None  # (else the reference's dequantize-and-matmul replays)
    _check_replays(f"tiny:{arch}", "bfloat16", call if native else None, quantization="fp8")


def _check_replays(path: str, dtype: str, native_call: str | None = None, **flags) -> None:
    """``native_call``: a C function every recorded step must call."""
    with Engine(model_path=path, dtype=dtype, debug_integrity=True, **POOLS, **flags) as eng:
        vocab = eng.model.vocab_size
        with checked_replays(eng) as checks:
            _generate(eng, _prompts(vocab, [240, 30, 7]), [30, 12, 5])
        eng.check_integrity()
        if native_call is not None:
            for graph in eng.runner.graphs.graphs:
                names = {getattr(fn, "__name__", None) for fn, _ in graph.program}
                assert native_call in names, (graph.key, sorted(filter(None, names))[:12])
        keys = {k[:2] for k, _, _ in checks}
        stats = eng.runner.graphs.stats
        reported = eng.stats()
    assert reported.decode_graph_replays == stats["replayed"]
    assert reported.decode_graph_recordings == stats["recorded"]
    assert reported.decode_graph_bytes > 0
    assert stats["replayed"] == len(checks) >= 20, stats
    assert {(3, 256), (2, 256), (1, 256), (1, 512)} <= keys, keys
    bad = [(k, logits, pools) for k, logits, pools in checks if not (logits and pools)]
    assert not bad, bad


def test_a_replay_missing_an_input_is_caught():
    """Negative control: a graph that does not write the step's token ids (or its state slots)
    replays stale inputs; the check above must see it."""
    original = step_graph.write_inputs
    for skipped in ("input_ids", "state_slots"):

        def partial_write(recorded, layout, skipped=skipped):
            keep = (
                recorded.input_ids.clone()
                if skipped == "input_ids"
                else recorded.decode.state_slots.clone()
            )
            original(recorded, layout)
            target = recorded.input_ids if skipped == "input_ids" else recorded.decode.state_slots
            target.copy_(keep)

        step_graph.write_inputs = partial_write
        try:
            with Engine(model_path="tiny:granite_hybrid", **POOLS) as eng:
                vocab = eng.model.vocab_size
                with checked_replays(eng) as checks:
                    # two batches of two: the second replays the first's graph over other
                    # slots, and every step has new tokens
                    _generate(eng, _prompts(vocab, [20, 33], seed=3), [8, 8])
                    _generate(eng, _prompts(vocab, [31, 17], seed=4), [8, 8])
        finally:
            step_graph.write_inputs = original
        assert checks, "nothing was replayed"
        assert not all(logits and pools for _, logits, pools in checks), skipped


def test_a_replay_missing_a_native_call_is_caught():
    """Negative control: a program with one state kernel call removed leaves a pool unlike the
    Python forward's."""
    original = step_graph._build

    def drop_one(*args, **kwargs):
        graph = original(*args, **kwargs)
        names = [getattr(fn, "__name__", "") for fn, _ in graph.program]
        graph.program.pop(next(i for i, n in enumerate(names) if "mamba2" in n))
        return graph

    step_graph._build = drop_one
    try:
        with Engine(model_path="tiny:granite_hybrid", **POOLS) as eng:
            with checked_replays(eng) as checks:
                _generate(eng, _prompts(eng.model.vocab_size, [25]), [6])
    finally:
        step_graph._build = original
    assert checks and not any(pools for _, _, pools in checks)


def test_replays_with_a_shared_prefix_equal_the_python_forward():
    """Cache on, requests sharing a 100-token system prompt decode together: their steps have
    a cascade attention plan (the shared prefix read once per group), whose shape is part of
    the key and whose tensors are written in; two batches of the same shape over different
    slots replay one recording; every replay equals the Python forward bit for bit."""
    checks = _shared_prefix_replays(write_plans=True)
    cascade = [k for k, _, _ in checks if k[-1]]
    assert len(cascade) >= 10, [k for k, _, _ in checks]
    assert all(logits and pools for _, logits, pools in checks)


def test_a_replay_missing_the_plan_inputs_is_caught():
    """Negative control: without the plan's tensors written in, the second batch replays the
    first one's shared-prefix rows and the check sees it."""
    checks = _shared_prefix_replays(write_plans=False)
    assert any(k[-1] for k, _, _ in checks)
    assert not all(logits and pools for _, logits, pools in checks)


def _shared_prefix_replays(write_plans: bool) -> list:
    g = torch.Generator().manual_seed(5)
    with Engine(model_path="tiny:qwen3_5", dtype="bfloat16", debug_integrity=True, **POOLS) as eng:
        if not write_plans:
            eng.backend.write_replay_inputs = lambda recorded, layout: None
        with checked_replays(eng) as checks:
            for _ in range(2):
                system = torch.randint(3, 400, (100,), generator=g).tolist()
                tails = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (4, 9, 6)]
                _generate(eng, [system + t for t in tails], [12, 12, 12])
        eng.check_integrity()
    return checks


FLAGS = [
    dict(disable_radix_cache=True),
    dict(mamba_scheduler_strategy="no_buffer", page_size=16),
    dict(mamba_scheduler_strategy="extra_buffer", mamba_track_interval=8),
    dict(mamba_scheduler_strategy="extra_buffer", disable_overlap_schedule=True),
]


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_engine_outputs_equal_with_graphs_on_and_off(flags):
    """Shared prefixes (decode steps with a cascade attention plan run the Python path), decode
    snapshots every 8 tokens (those steps run the Python path too), seeded sampling: the same
    ids and logprobs with graphs on and off, and replays happened."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 400, (70,), generator=g).tolist()
    prompts = [system + torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 9, 14)]
    prompts += _prompts(400, [12, 50], seed=8)
    new = [20, 14, 9, 17, 11]
    runs = {}
    for off in (True, False):
        with Engine(
            model_path="tiny:qwen3_5", debug_integrity=True, disable_decode_graph=off,
            **POOLS, **flags,
        ) as eng:  # fmt: skip
            greedy = _generate(eng, prompts, new)
            sampled = _generate(eng, prompts, new, temperature=0.8, top_p=0.9, seed=11)
            eng.check_integrity()
            stats = None if off else dict(eng.runner.graphs.stats)
        runs[off] = (greedy, sampled)
    assert stats["replayed"] >= 5, stats
    for a, b in zip(runs[True], runs[False]):
        for x, y in zip(a, b):
            assert x["output_ids"] == y["output_ids"]
            lp = "output_token_logprobs"
            assert x["meta_info"][lp] == y["meta_info"][lp]


def test_moe_steps_are_refused_and_still_correct():
    """An fp32 MoE layer's routing is read by Python (a bf16 decode batch's routed experts run
    in one C call that returns nothing, replayed above): the padded pair layout's expert count
    (``moe_pad``) in batches of as many (token, expert) pairs as experts (batches 5 and 4 below:
    10 and 8 pairs over 8 experts), the per-expert loop's ``bincount`` in smaller ones (3, 2, 1).
    The recordings are refused, the steps run the Python path, outputs equal those without
    graphs; after REFUSALS_TO_STOP keys refused for one reason nothing more is recorded."""
    outs = {}
    for off in (True, False):
        with Engine(model_path="tiny:granite_hybrid_moe", disable_decode_graph=off, **POOLS) as e:
            prompts = _prompts(e.model.vocab_size, [15, 22, 9, 30, 12])
            outs[off] = _generate(e, prompts, [3, 5, 7, 9, 11])
            stats = None if off else dict(e.runner.graphs.stats)
            kept = None if off else e.runner.graphs.graphs
            stopped = None if off else e.runner.graphs.stopped
    assert stats.get("replayed", 0) == 0 and not kept
    refused = {k: v for k, v in stats.items() if k.startswith("refused: ")}
    assert refused == {
        "refused: Python reads what native moe_pad returns": 2,
        "refused: an output shape depends on the data (aten.bincount.default)": 3,
    }, stats
    assert step_graph.REFUSALS_TO_STOP == 3 and "bincount" in stopped
    assert [o["output_ids"] for o in outs[True]] == [o["output_ids"] for o in outs[False]]


def _record(fn, *tensors):
    """Record ``fn(*tensors)`` as a step would be, and build it (the given tensors static)."""
    from mambaradix.kernels import native

    with native.recording() as calls, step_graph._Recorder(calls) as rec:
        out = fn(*tensors)
    spans = {step_graph._storage_span(t) for t in tensors}
    return step_graph._build((1, 0), None, out, calls, rec, spans)


@pytest.mark.parametrize(
    "fn,why",
    [
        (lambda x: x * float(x.sum()), "Python read a tensor's data"),
        (lambda x: x[x > 0], "depends on the data"),
        (lambda x: x + torch.tensor(x.tolist()), "Python"),
        (lambda x: x + torch.rand(3), "random"),
    ],
)
def test_recordings_that_read_data_are_refused(fn, why):
    with torch.inference_mode(), pytest.raises(step_graph.RecordingRefused, match=why):
        _record(fn, torch.randn(3))


def test_a_native_call_outside_the_graphs_memory_is_refused():
    """A kernel handed a tensor the recording never saw (made before it, not static) would read
    freed memory on a replay: refused. The same call over a static tensor records."""
    from mambaradix.kernels import cpu, native

    if not native.available():
        pytest.skip("native kernels did not build here")
    w = torch.ones(64)
    outside = torch.randn(2, 64)
    with torch.inference_mode():
        with pytest.raises(step_graph.RecordingRefused, match="memory"):
            _record(lambda: cpu.rms_norm(outside, w, 1e-6, False))
        graph = _record(lambda x, w: cpu.rms_norm(x, w, 1e-6, False), outside, w)
    assert graph.native_calls == 1


def test_a_replay_reruns_the_torch_ops_into_their_recorded_tensors():
    """The program reruns functional ops into the tensors they returned (a new input gives the
    new result in the same tensor), in-place ops in place; views and allocations only once."""
    x = torch.randn(4, 8)
    acc = torch.zeros(8)

    def step(x, acc):
        y = (x.float() * 2).sum(0)  # to (a no-op), mul, sum
        acc.add_(y)  # in place
        return y.view(2, 4)

    with torch.inference_mode():
        graph = _record(step, x, acc)
        first = graph.logits.clone()
        x.copy_(torch.randn(4, 8))
        for fn, args in graph.program:
            fn(*args)
    assert torch.equal(graph.logits, (x * 2).sum(0).view(2, 4))
    assert not torch.equal(graph.logits, first)
    assert torch.equal(acc, (first + graph.logits).flatten())
    assert graph.torch_ops == 3 and graph.native_calls == 0


def test_table_capacity():
    assert [step_graph.table_capacity(n) for n in (1, 255, 256, 257, 1000, 1024, 1025)] == [
        256, 256, 256, 512, 1024, 1024, 2048,
    ]  # fmt: skip


def test_graphs_kept_are_bounded():
    """At most ``max_graphs`` graphs are kept (least recently replayed dropped), outputs
    unchanged."""
    with Engine(model_path="tiny:lfm2", **POOLS) as eng:
        eng.runner.graphs.max_graphs = 2
        with checked_replays(eng) as checks:
            _generate(eng, _prompts(eng.model.vocab_size, [10, 20, 30, 40]), [4, 7, 10, 13])
        assert len(eng.runner.graphs.graphs) == 2
        assert eng.runner.graphs.stats["recorded"] >= 4
        eng.runner.graphs.max_graphs = 8
        eng.runner.graphs.max_bytes = max(g.nbytes for g in eng.runner.graphs.graphs) + 1
        _generate(eng, _prompts(eng.model.vocab_size, [11, 21, 31]), [4, 7, 10])
        assert len(eng.runner.graphs.graphs) == 1  # two would not fit the bytes
    assert checks and all(logits and pools for _, logits, pools in checks)


def test_flags():
    with Engine(model_path="tiny:lfm2", disable_decode_graph=True, skip_warmup=True) as eng:
        assert eng.runner.graphs is None
    with Engine(model_path="tiny:lfm2", decode_graph_max_bs=2, **POOLS) as eng:
        _generate(eng, _prompts(eng.model.vocab_size, [10, 11, 12]), [5, 5, 5])
        assert all(g.key[0] <= 2 for g in eng.runner.graphs.graphs)
        assert eng.runner.graphs.graphs
    with pytest.raises(ValueError, match="decode-graph-max-bs"):
        Engine(model_path="tiny:lfm2", decode_graph_max_bs=-1)
