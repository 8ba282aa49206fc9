"""CPU runtime settings: one OpenMP worker pool (the thread that built the engine releases its
own, the engine thread never starts one), and glibc malloc told to keep freed memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

ONE_CORE = (os.cpu_count() or 1) < 2

SCRIPT = textwrap.dedent(
    """
    import os, torch
    from mambaradix.engine.cpu_runtime import release_thread_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    before = threads()
    torch.randn(4_000_000).exp_()  # a parallel region: this thread gets a worker pool
    with_pool = threads()
    ok = release_thread_pool()
    print(before, with_pool, threads(), ok)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(ONE_CORE, reason="one core: torch starts no workers")
def test_release_thread_pool_frees_the_callers_workers():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    before, with_pool, after, ok = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert with_pool > before  # the parallel op started workers
    assert ok == "True"
    assert after == before  # and releasing the pool stopped them


SERIAL_SCRIPT = textwrap.dedent(
    """
    import os, threading, torch
    from mambaradix.engine.cpu_runtime import serial_torch_thread

    def tids():  # thread ids, not a count: a joined thread may still be listed while it exits
        return set(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    out = {}

    def work(name, serial):
        ok = serial_torch_thread() if serial else None
        before = tids()
        x = torch.randn(4_000_000)
        x.exp_()  # MKL's vector math (its own threads)
        x.index_select(0, torch.arange(0, 4_000_000, 2))  # ATen's parallel loop
        out[name] = (ok, torch.get_num_threads(), len(tids() - before))

    # plain second: it must still start from the process-wide count, and its pool stays
    for name, serial in (("serial", True), ("plain", False)):
        t = threading.Thread(target=work, args=(name, serial))
        t.start()
        t.join()
    print(*out["serial"], *out["plain"], torch.get_num_threads())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(ONE_CORE, reason="one core: torch starts no workers")
def test_serial_torch_thread_starts_no_pool_and_leaves_other_threads_parallel():
    out = subprocess.run(
        [sys.executable, "-c", SERIAL_SCRIPT], capture_output=True, text=True, check=True,
        timeout=120,
    ).stdout.split()  # fmt: skip
    ok, serial_threads, serial_new = out[0], int(out[1]), int(out[2])
    plain_threads, plain_new, main_threads = int(out[4]), int(out[5]), int(out[6])
    assert ok == "True" and serial_threads == 1
    assert serial_new == 0  # the big op ran without starting workers
    assert plain_threads == 2 and plain_new > 0  # control: a thread without it starts a pool
    assert main_threads == 2  # and the process-wide setting is untouched


@pytest.mark.skipif(ONE_CORE, reason="one core: torch is serial anyway")
def test_engine_thread_runs_torch_serially():
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from engine_helpers import GREEDY, fake_engine

    with fake_engine() as engine:
        engine.generate(input_ids=[1, 2, 3, 4], sampling_params=GREEDY)  # starts the runner
        assert engine.call(torch.get_num_threads) == 1  # the scheduler's thread
        runner_thread = engine.runner._executor
        assert runner_thread.submit(torch.get_num_threads).result() > 1  # the runner's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_freed_memory_is_accepted_by_glibc():
    from mambaradix.engine.cpu_runtime import keep_freed_memory

    assert keep_freed_memory() is True


def test_on_thread_runs_on_the_runners_worker_where_the_forwards_run():
    import threading

    from engine_helpers import GREEDY, fake_engine

    with fake_engine() as engine:
        runner, forwards = engine.runner, set()
        run = runner.run

        def recording(batch):
            forwards.add(threading.get_ident())
            return run(batch)

        runner.run = recording  # submit() looks it up on every batch
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)
        here = runner.on_thread(threading.get_ident).result()
        assert forwards == {here}, "the forwards ran on another thread than on_thread's"
        assert here != threading.get_ident()
        engine.check_integrity()
