"""CPU runtime settings: one OpenMP worker pool (the thread that built the engine releases its
own), and glibc malloc told to keep freed memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

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
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one core: torch starts no workers")
def test_release_thread_pool_frees_the_callers_workers():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    before, with_pool, after, ok = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert with_pool > before  # the parallel op started workers
    assert ok == "True"
    assert after == before  # and releasing the pool stopped them


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_freed_memory_is_accepted_by_glibc():
    from mambaradix.engine.cpu_runtime import keep_freed_memory

    assert keep_freed_memory() is True
