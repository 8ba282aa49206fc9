"""CPU runtime settings for the runner: one OpenMP worker pool, and a malloc that keeps memory.

**OpenMP pools.**
The OpenMP runtime (libgomp in the CPU torch builds) keeps one pool of worker threads per
thread that has started a parallel region. While the pools together hold more threads than
there are CPUs, libgomp throttles: a worker barely spins between regions and sleeps on a futex,
so every op pays a wake-up: small ops cost several times more once a second pool exists, and a
whole decode step nearly twice as much (figures in docs/benchmarks.md).

Loading a model runs torch on the caller's thread and leaves a pool there; the runner computes
on its own worker thread, which starts a second one. ``release_thread_pool()`` frees the calling
thread's pool (OpenMP 5 ``omp_pause_resource_all``); the engine calls it on the thread that
built it. If that thread later runs parallel torch ops again, it gets a new pool (correct, only
slower).

The engine thread (scheduler) runs small torch ops of its own, such as gathering the slot rows
of a decode step from the request table. One of them above torch's grain size was enough to
start a pool there: libgomp then counted more threads than CPUs and cut the runner's spinning
to almost nothing, so its worker slept and was woken by futex at every parallel region (hundreds
of times per decode step). ``serial_torch_thread()`` makes torch run the calling thread's ops on
that thread alone; the engine thread calls it first thing.

**malloc.** A forward allocates and frees many temporaries of a few to tens of MB. glibc returns
such memory to the OS (large blocks are mmap'ed, the heap top is trimmed) and the next forward
faults it back in page by page: about 70k page faults and ~15% of a prefill forward on the
benchmark model. ``keep_freed_memory()`` raises the mmap threshold to 32 MB (the top of
glibc's own dynamic range) and the trim threshold to 1 GB, so freed blocks are reused
instead (the process keeps up to that much freed memory, as a caching allocator would). Threads
other than the main one allocate from arenas of their own, built of heaps of at most 64 MB;
glibc unmaps such a heap as soon as it is empty, whatever the trim threshold, unless the
"top pad" (memory kept beyond the top chunk) is at least a heap's size. So the top pad is set
to 64 MB too. Without it, the runner thread's forwards in the gsp benchmark's cache-on run
faulted 50-135k pages in every prefill batch, up to 0.8 s of system time in one batch; with
it, the faults stop after the first batch.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from mambaradix.kernels.openmp import openmp_runtime_path

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # glibc's largest thread-arena heap (HEAP_MAX_SIZE on 64-bit)
OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what is cheap to keep


def _openmp_runtime() -> ctypes.CDLL | None:
    path = openmp_runtime_path()
    return ctypes.CDLL(path) if path is not None else None


def release_thread_pool() -> bool:
    """Free the OpenMP worker pool of the calling thread. True if the runtime accepted.

    Must not be called from inside a parallel region (torch never calls back into Python
    from one)."""
    lib = _openmp_runtime()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(ctypes.c_int(OMP_PAUSE_SOFT)) == 0
    logger.debug("released this thread's OpenMP pool: %s", ok)
    return ok


def serial_torch_thread() -> bool:
    """Run the calling thread's torch ops on this thread alone, so that it never starts an
    OpenMP pool, nor MKL's (see the module docstring). Other threads keep their settings.
    True if this thread now runs serially."""
    n = torch.get_num_threads()  # torch sets a thread's count when it first asks: do it now
    if n == 1:
        return True
    # Per thread for OpenMP and MKL, but it also stores 1 as the process-wide count that new
    # threads start from: put that back from a short-lived thread, leaving this one at 1.
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(n,), name="torch-threads")
    restore.start()
    restore.join()
    ok = torch.get_num_threads() == 1
    logger.debug("torch ops on this thread run serially: %s", ok)
    return ok


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse (see the module docstring). True if applied;
    False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    ok = mallopt(M_TOP_PAD, TOP_PAD) == 1 and ok
    logger.debug("malloc keeps freed memory: %s", ok)
    return ok
