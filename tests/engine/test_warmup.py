"""The warm-up at engine start: a prefill forward of WARMUP_MIN_TOKENS, a larger prefill batch
where the budget allows, then a decode step of all its requests and one of a single request,
on scratch slots all back in their pools afterwards, and nothing of it visible to requests."""

from __future__ import annotations

from engine_helpers import GREEDY, fake_engine, rand_tokens
from fake_model import FakeModel

from mambaradix.engine import runner as runner_module


def test_warmup_runs_one_full_batch_and_frees_its_slots():
    with fake_engine(max_prefill_tokens=300, chunked_prefill_size=64) as engine:
        # 256 tokens, the whole 300-token batch, two decode steps: before any request
        assert engine.model.forwards == 4
        kv_free, state_free = engine.kv_pool.available(), engine.state_pool.available()
        assert kv_free == engine.kv_pool.size and state_free == engine.state_pool.size
        engine.check_integrity()
        # run again on the engine thread (idle): the shape it builds, and the slots it returns
        ran = engine.call(lambda: engine.runner.warmup(300, 64))
        assert ran == 300  # 4 requests of 64 + one of 44
        assert engine.model.forwards == 8
        assert engine.kv_pool.available() == kv_free
        assert engine.state_pool.available() == state_free
        engine.check_integrity()


def test_warmup_shrinks_to_the_pools():
    with fake_engine(max_total_tokens=256, max_mamba_cache_size=8) as engine:
        # 8 state slots: at most 8 requests of 16 tokens
        assert engine.call(lambda: engine.runner.warmup(4096, 16)) == 128
        # 256 KV slots: the batch is cut to them
        assert engine.call(lambda: engine.runner.warmup(4096, 512)) == 256
        engine.check_integrity()
        assert engine.kv_pool.available() == 256 and engine.state_pool.available() == 8


def test_skip_warmup_and_outputs_do_not_depend_on_it(rng):
    prompts = [rand_tokens(rng, n) for n in (5, 70, 130, 200)]
    outs = []
    for skip in (True, False):
        with fake_engine(skip_warmup=skip, page_size=16) as engine:
            assert engine.model.forwards == (0 if skip else 4)
            res = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            outs.append([r["output_ids"] for r in res])
            engine.check_integrity()
    assert outs[0] == outs[1]


def test_warmup_runs_decode_shapes(monkeypatch):
    """The warm-up's second and third forwards are decode steps (one new token per request,
    over the keys before it) with the scheduler's slot table: all requests, then one."""
    shapes = []
    forward = FakeModel.forward

    def recording(self, ctx, all_logits=False):
        shapes.append([(r.prefix_len, len(r.input_ids)) for r in ctx.layout.reqs])
        return forward(self, ctx, all_logits)

    monkeypatch.setattr(FakeModel, "forward", recording)
    with fake_engine(max_prefill_tokens=200, chunked_prefill_size=64) as engine:
        engine.check_integrity()
    # 200 tokens wanted: under WARMUP_MIN_TOKENS, so one prefill forward of them all
    assert shapes[0] == [(0, 64), (0, 64), (0, 64), (0, 8)]
    assert shapes[1] == [(63, 1), (63, 1), (63, 1), (7, 1)]
    assert shapes[2] == [(63, 1)]
    assert len(shapes) == 3


def test_warmup_batch_is_cut_to_its_budget(monkeypatch):
    """A slow model (here: a zero budget) runs one prefill of WARMUP_MIN_TOKENS (its last
    request cut to fit) and the decode steps; a fast one (a large budget) a larger batch."""
    shapes: list[list[tuple[int, int]]] = []
    recording = FakeModel.forward

    def record(self, ctx, all_logits=False):
        shapes.append([(r.prefix_len, len(r.input_ids)) for r in ctx.layout.reqs])
        return recording(self, ctx, all_logits)

    monkeypatch.setattr(runner_module, "WARMUP_MIN_TOKENS", 150)
    with fake_engine(max_prefill_tokens=300, chunked_prefill_size=64) as engine:
        monkeypatch.setattr(FakeModel, "forward", record)
        ran = engine.call(lambda: engine.runner.warmup(300, 64, budget_s=0.0))
        assert ran == 150
        assert shapes == [[(0, 64), (0, 64), (0, 22)], [(63, 1), (63, 1), (21, 1)], [(63, 1)]]
        assert engine.kv_pool.available() == engine.kv_pool.size
        shapes.clear()
        assert engine.call(lambda: engine.runner.warmup(300, 64, budget_s=1e6)) == 300
        assert shapes[0] == [(0, 64), (0, 64), (0, 22)]
        assert shapes[1] == [(0, 64)] * 4 + [(0, 44)]
        assert len(shapes) == 4
        engine.check_integrity()


def test_malloc_keeps_freed_memory_before_the_warmup(monkeypatch):
    """The warm-up grows the heap to a forward's working size; with glibc still returning freed
    blocks to the OS that growth would be undone after every forward (the first request paying
    it again), so the malloc settings come first."""
    from mambaradix.engine import wiring as engine_module

    order = []
    monkeypatch.setattr(engine_module, "keep_freed_memory", lambda: order.append("keep"))
    warmup = runner_module.ModelRunner.warmup

    def recording(self, *a, **k):
        order.append("warmup")
        return warmup(self, *a, **k)

    monkeypatch.setattr(runner_module.ModelRunner, "warmup", recording)
    with fake_engine():
        pass
    assert order == ["keep", "warmup"]
