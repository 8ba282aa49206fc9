"""The storage tier through the engine: outputs (ids and logprobs) never depend on it, for both
strategies, page sizes 1 and 16 and every write policy, with states evicted from small RAM pools
and loaded back, after a restart, across two processes sharing a directory, and with corrupt,
truncated, foreign and misfiled objects (each a miss, removed). A state filed under another
prompt's key does change the outputs (negative control): the key and header checks are what
keep them right. ``check_integrity`` runs after every step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from equivalence_helpers import REFERENCE, compare, run, workload

from mambaradix.cache.integrity import IntegrityError
from mambaradix.cache.storage.objects import decode, encode
from mambaradix.engine.engine import Engine

PARAMS = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True, "return_logprob": True}


@pytest.fixture(scope="module", params=["qwen3_next", "granite_hybrid"])
def model(request):
    from mambaradix.models.loader import load_model, load_tokenizer, resolve_model_path

    path = resolve_model_path(f"tiny:{request.param}")
    return path, load_model(path), load_tokenizer(path)


@pytest.fixture(scope="module")
def prompts(model):
    return workload(model[1].vocab_size, n=48, seed=3)


@pytest.fixture(scope="module")
def reference(model, prompts):
    return run(model[1], model[2], prompts, REFERENCE)[0]


def engine(model, root, **flags) -> Engine:
    flags.setdefault("hicache_write_policy", "write_back")
    return Engine(
        model=model[1],
        tokenizer=model[2],
        debug_integrity=True,
        skip_warmup=True,
        enable_hierarchical_cache=True,
        hicache_storage_dir=str(root),
        max_total_tokens=1 << 14,
        **flags,
    )


def generate(eng: Engine, prompts):
    out = eng.generate(input_ids=prompts, sampling_params=PARAMS)
    assert eng.is_idle()
    eng.check_integrity()
    return out


def objects(root: Path) -> list[Path]:
    return sorted(p for p in (root / "objects").rglob("*") if p.is_file())


def assert_same(ref, got) -> None:
    ties, _ = compare(ref, got)
    assert ties <= 1


@pytest.mark.parametrize(
    "strategy,page,policy",
    [
        ("no_buffer", 1, "write_back"),
        ("extra_buffer", 1, "write_through"),
        ("no_buffer", 16, "write_through_selective"),
        ("extra_buffer", 16, "write_back"),
    ],
)
def test_beyond_ram_equals_reference(model, prompts, reference, tmp_path, strategy, page, policy):
    """State pools far too small for the workload: evicted prefixes come back from storage,
    outputs equal the cache-off reference; the second pass hits deeper than RAM alone would,
    and no load is wasted: the requests waiting for a loaded state pin it until they run, so
    at least as many requests resume from storage as loads were made (without the pin the
    others' snapshots freed some first, and some runs hit none: the control below)."""
    flags = dict(
        mamba_scheduler_strategy=strategy,
        page_size=page,
        max_mamba_cache_size=12,
        hicache_write_policy=policy,
        chunked_prefill_size=64,
    )
    with engine(model, tmp_path, **flags) as eng:
        first = generate(eng, prompts)
        assert_same(reference, first)
        second = generate(eng, prompts)
        assert_same(reference, second)
        stats = eng.stats()
        assert stats.storage_objects_written > 0
        assert stats.evicted_states > 0
        if policy != "write_through_selective":  # selective keeps only prefixes used twice
            assert stats.storage_loads > 0
            assert stats.storage_hit_tokens > 0
            assert sum(o["meta_info"]["cached_tokens_details"]["storage"] for o in second) > 0
        for o in second:
            d = o["meta_info"]["cached_tokens_details"]
            assert d["device"] + d["storage"] == o["meta_info"]["cached_tokens"]
        resumed = sum(o["meta_info"]["cached_tokens_details"]["storage"] > 0 for o in second)
        assert resumed >= stats.storage_loads, (resumed, stats.storage_loads)
        assert eng.call(eng.cache.flush) is not None  # nothing left locked by loads
        eng.check_integrity()
        assert eng.kv_pool.available() == eng.kv_pool.size
        assert eng.state_pool.available() == eng.state_pool.size


def test_loads_not_pinned_are_wasted(model, prompts, tmp_path, monkeypatch):
    """Negative control: with the waiting requests' pins on loaded states off, other requests'
    snapshots and admissions free some loaded states before their requests run."""
    import mambaradix.engine.admission as admission
    import mambaradix.engine.scheduler as scheduler

    for module in (admission, scheduler):
        monkeypatch.setattr(module, "pin_loaded", lambda *args: None)
    flags = dict(mamba_scheduler_strategy="extra_buffer", max_mamba_cache_size=12,
                 hicache_write_policy="write_back", chunked_prefill_size=64)  # fmt: skip
    with engine(model, tmp_path, **flags) as eng:
        generate(eng, prompts)
        second = generate(eng, prompts)
        loads = eng.stats().storage_loads
    resumed = sum(o["meta_info"]["cached_tokens_details"]["storage"] > 0 for o in second)
    assert loads > 0 and resumed < loads, (resumed, loads)


def test_restart_loads_every_prefix(model, prompts, reference, tmp_path):
    """A new engine on the same directory resumes every repeated prompt from storage: at least
    the exact-repeat hit, outputs unchanged."""
    with engine(model, tmp_path, hicache_write_policy="write_through") as eng:
        assert_same(reference, generate(eng, prompts))
    with engine(model, tmp_path) as eng:
        again = generate(eng, prompts)
        assert_same(reference, again)
        assert eng.stats().storage_loads > 0
    for p, o in zip(prompts, again):
        if len(p) > 64:
            assert o["meta_info"]["cached_tokens_details"]["storage"] >= (len(p) - 1) // 64 * 64


def test_write_back_shutdown_then_restart(model, prompts, reference, tmp_path):
    """write_back with room for everything writes nothing while serving; a graceful shutdown
    writes what RAM holds, and the next start finds it."""
    with engine(model, tmp_path, hicache_write_policy="write_back") as eng:
        generate(eng, prompts)
        assert eng.stats().storage_objects_written == 0
    assert objects(tmp_path)
    with engine(model, tmp_path) as eng:
        assert_same(reference, generate(eng, prompts))
        assert eng.stats().storage_hit_tokens > 0


CHILD = textwrap.dedent(
    """
    import sys, time
    from mambaradix.engine.engine import Engine
    from mambaradix.models.loader import load_model, load_tokenizer
    path, root, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    sys.path.insert(0, sys.argv[5])
    from equivalence_helpers import workload
    model, tok = load_model(path), load_tokenizer(path)
    prompts = workload(model.vocab_size, n=48, seed=3)
    with Engine(model=model, tokenizer=tok, skip_warmup=True, enable_hierarchical_cache=True,
                hicache_storage_dir=root, hicache_write_policy="write_through",
                max_total_tokens=1 << 14) as eng:
        params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
        if mode == "loop":  # keep writing until killed
            print("ready", flush=True)
            i = 0
            while True:
                i += 1
                eng.generate(input_ids=[p + [i % 50 + 3] * 70 for p in prompts[:8]],
                             sampling_params=params)
        eng.generate(input_ids=prompts[:n], sampling_params=params)
    print("done", flush=True)
    """
)


def child(model, root, n, mode) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(model[0]), str(root), str(n), mode,
         os.path.dirname(__file__)],
        stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip


def test_second_process_shares_the_directory(model, prompts, reference, tmp_path):
    """Another process writes; this one reads: a prefix computed once, by any process, is a
    hit."""
    p = child(model, tmp_path, 24, "once")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and "done" in out
    with engine(model, tmp_path) as eng:
        got = generate(eng, prompts)
        assert_same(reference, got)
        assert sum(o["meta_info"]["cached_tokens_details"]["storage"] for o in got[:24]) > 0


def test_sigkill_during_writes_then_restart(model, prompts, reference, tmp_path):
    """A process killed with SIGKILL while writing leaves no partial object: the next start
    serves the same outputs and finds no bad object."""
    p = child(model, tmp_path, 0, "loop")
    assert p.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 120
    while len(objects(tmp_path)) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert objects(tmp_path), "the child wrote nothing before it was killed"
    with engine(model, tmp_path) as eng:
        assert_same(reference, generate(eng, prompts))
        assert eng.stats().storage_bad_objects == 0


def _state_objects(root: Path) -> list[Path]:
    return [p for p in objects(root) if p.name.startswith("st-")]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "misfiled"])
def test_bad_objects_are_misses(model, prompts, reference, tmp_path, caplog, damage):
    """Every stored state damaged: each load is a miss, logged, the object removed; outputs
    unchanged."""
    with engine(model, tmp_path, hicache_write_policy="write_through") as eng:
        generate(eng, prompts)
    states = _state_objects(tmp_path)
    assert states
    damaged: dict[Path, bytes] = {}
    for i, path in enumerate(states):
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-5] ^= 0x40
        elif damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "foreign":  # another model's fingerprint, same length
            fp = eng.cache.storage.fingerprint.encode()
            data = data.replace(fp, bytes(reversed(fp)), 1)
        else:  # another prompt's state under this key
            data = bytearray(states[(i + 1) % len(states)].read_bytes())
        damaged[path] = bytes(data)
    for path, data in damaged.items():
        path.write_bytes(data)
    with engine(model, tmp_path) as eng:
        got = generate(eng, prompts)
        assert_same(reference, got)
        stats = eng.stats()
        assert stats.storage_bad_objects > 0
        assert stats.storage_loads == 0
    assert "unusable" in caplog.text
    # the bad objects a load met were removed (and written again, valid, at shutdown)
    removed = [p for p, d in damaged.items() if not p.exists() or p.read_bytes() != d]
    assert len(removed) >= stats.storage_bad_objects > 0


def test_misfiled_state_with_valid_header_changes_outputs(model, prompts, reference, tmp_path):
    """Negative control: the state of one prompt re-encoded under another prompt's key (header
    and checksum valid) is loaded and changes that prompt's outputs: only the content key
    keeps a stored state with the tokens it belongs to."""
    a = list(range(3, 103)) + [5] * 40
    b = list(range(103, 203)) + [7] * 40
    with engine(model, tmp_path, hicache_write_policy="write_through") as eng:
        ref_b = generate(eng, [b])
        generate(eng, [a])
        tier = eng.cache.storage
        assert tier.drain(30)
        pos = len(a) - 1  # the exact-repeat snapshot
        key_a = tier.chain.state_key_at(a, pos)
        key_b = tier.chain.state_key_at(b, pos)
        spec = tier._state_specs + tier._kv_specs(pos % tier.block, "tail_")
        data = tier.backend.get([key_a])[0]
        assert data is not None, f"the state of a at {pos} was not stored"
        ts = decode(data, key=key_a, fingerprint=tier.fingerprint, kind="state", expected=spec)
        tier.backend.delete([key_b])
        tier.backend.put([(key_b, encode(key_b, tier.fingerprint, "state", list(ts.items())))])
    with engine(model, tmp_path) as eng:
        got_b = generate(eng, [b])
        assert got_b[0]["meta_info"]["cached_tokens_details"]["storage"] == pos
    lp_ref = ref_b[0]["meta_info"]["output_token_logprobs"]
    lp_got = got_b[0]["meta_info"]["output_token_logprobs"]
    assert max(abs(x - y) for x, y in zip(lp_ref, lp_got)) > 1e-3


def test_write_failures_keep_serving(model, prompts, reference, tmp_path):
    """A backend that refuses every write (a full disk): serving goes on from RAM, outputs
    unchanged, failures counted."""
    with engine(model, tmp_path, hicache_write_policy="write_through") as eng:
        eng.cache.storage.backend.put = lambda items: [False] * len(items)
        assert_same(reference, generate(eng, prompts))
        eng.cache.storage.drain(30)
        stats = eng.stats()
        assert stats.storage_write_failures > 0 and stats.storage_objects_written == 0


def test_integrity_knows_stored_residency(model, prompts, tmp_path):
    """A node marked stored must be known to the tier: a false mark is caught."""
    with engine(model, tmp_path, hicache_write_policy="write_back") as eng:
        generate(eng, prompts[:6])

        def mark_one() -> None:
            stack = list(eng.cache.tree.root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node.state_slot is not None:
                    node.stored = True
                    return
            raise AssertionError("no state in the tree")

        eng.call(mark_one)
        with pytest.raises(IntegrityError, match="stored"):
            eng.check_integrity()
