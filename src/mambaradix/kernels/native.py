"""Native CPU kernels: C sources in ``kernels/csrc``, built when the package is installed
(or on first use) and loaded with ctypes.

A decode step of a hybrid model is many small operations. Where the torch reference needs
several passes over a tensor (gather the states of the batch, update them in five elementwise
and matmul ops, scatter them back), a C kernel reads and writes each state once, in place in
the pool. These kernels are the primitives of the ``"cpu"`` backend (``kernels.cpu_backend``),
which the engine picks on CPU when they build (``--kernel-backend auto``).

Build (``kernels.native_build``): the system C compiler (``$CC``, else ``cc``) with ``-O3
-march=native``, under a name that hashes the sources, the flags, the compiler and the CPU's
model and features. ``pip install`` (``-e`` or not) compiles every library into
``kernels/prebuilt`` (setup.py); a library found there under the name this process would give
it is loaded as it is. Otherwise (a source tree never installed, sources edited since, another
compiler or CPU) the missing ones are compiled at once into a cache folder
(``$MAMBARADIX_KERNEL_CACHE``, else ``~/.cache/mambaradix/kernels``), written whole or not at
all, so concurrent processes never load a half-written file; ``origins()`` says which
happened. OpenMP: only when the process's OpenMP runtime is libgomp (the CPU torch builds),
whose already-loaded copy (``kernels.openmp``) the kernel then shares: one worker pool, see
``engine.cpu_runtime``. Otherwise the kernels run single-threaded. No compiler, or a failed
build, leaves the torch kernels in place with one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mambaradix.kernels import native_build
from mambaradix.kernels.openmp import openmp_runtime_path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

# exported C functions and their argument types
SIGNATURES: dict[str, dict[str, list]] = {
    "gated_delta_decode": {
        "gated_delta_decode": [
            _I64, _PTR,            # B, slots
            _PTR, _PTR,            # cu [B+1], row_slots (nullable: one row each, in place)
            _PTR, _I64,            # x, x row stride
            _PTR, _PTR,            # conv pool, ssm pool
            _PTR, _PTR,            # conv weight, conv bias (nullable)
            _PTR, _I64, _PTR, _I64,  # a, its row stride, b, its row stride
            _PTR, _PTR,            # A_log, dt_bias
            _PTR,                  # out
            _I64, _I64, _I64, _I64, _I64,  # Hk, Hv, Dk, Dv, conv kernel width
            _INT, _INT,            # silu, l2norm
            _PTR, _I64,            # gate z (nullable), its row stride
            _PTR, ctypes.c_float,  # output norm weight (nullable: no norm), eps
            ctypes.c_float,        # beta scale
        ],
    },
    "ssm_decode": {
        "conv1d_update": [
            _I64, _PTR,            # B, slots
            _PTR, _PTR,            # cu [B+1], row_slots (nullable: one row each, in place)
            _PTR, _I64,            # x, its row stride
            _PTR,                  # conv pool
            _PTR, _PTR,            # weight, bias (nullable)
            _PTR,                  # out [rows, C]
            _I64, _I64, _INT,      # C, kernel width, silu
        ],
        "mamba2_step": [
            _I64, _PTR,            # B, slots
            _PTR, _PTR,            # cu [B+1], row_slots (nullable: one row each, in place)
            _PTR,                  # ssm pool (fp32)
            _PTR, _I64,            # x, its row stride
            _PTR, _PTR,            # dt [rows, H] fp32, A [H] fp32
            _PTR, _PTR, _I64,      # B, C, their row stride
            _PTR,                  # D (nullable)
            _PTR,                  # y [rows, H, P] fp32
            _I64, _I64, _I64, _I64,  # H, P, G, N
        ],
        "mamba2_decode": [
            _I64, _PTR,            # B, slots
            _PTR, _PTR,            # cu [B+1], row_slots (nullable: one row each, in place)
            _PTR, _PTR, _I64,      # xBC, raw dt (views of one projection), their row stride
            _PTR, _PTR, _PTR,      # conv pool, conv weight, conv bias (nullable)
            _I64, _INT,            # conv kernel width, silu
            _PTR,                  # ssm pool (fp32)
            _PTR, _PTR,            # A_log, dt_bias
            ctypes.c_float, ctypes.c_float,  # dt limits
            _PTR,                  # D (nullable)
            _PTR,                  # y [rows, H, P], model dtype
            _I64, _I64, _I64, _I64,  # H, P, G, N
            _PTR,                  # gate z (nullable), xBC's row stride
            _PTR, ctypes.c_float, _I64,  # output norm weight (nullable: no norm), eps, group
            _PTR,                  # out [rows, H * P] (with the norm)
        ],
        "mamba2_scan": [
            _I64, _PTR, _PTR,      # S segments, cu_seqlens [S+1], slots [S]
            _PTR,                  # ssm pool (fp32)
            _PTR, _I64, _I64,      # x, its token and channel strides
            _PTR, _PTR,            # dt [T, H] fp32, A [H] fp32
            _PTR, _PTR, _I64, _I64,  # B, C, their token and channel strides
            _PTR,                  # D (nullable)
            _PTR,                  # y [T, H, P] fp32
            _I64, _I64, _I64, _I64,  # H, P, G, N
            _I64, _PTR, _PTR, _PTR,  # K snapshots: segment, offset, slot (by segment, offset)
        ],
    },
    "conv_prefill": {
        "conv1d_prefill": [
            _I64, _PTR, _PTR,      # S segments, cu_seqlens [S+1], slots [S]
            _PTR, _I64,            # x, its row stride
            _PTR,                  # conv pool
            _PTR, _PTR,            # weight [C, K], bias (nullable)
            _PTR,                  # out [T, C]
            _I64, _I64, _INT,      # C, kernel width, silu
            _I64, _PTR, _PTR, _PTR,  # K snapshots: segment, offset, slot (by segment, offset)
        ],
    },
    "gated_delta_scan": {
        "gated_delta_scan": [
            _I64, _PTR, _PTR,      # S segments, cu_seqlens [S+1], slots [S]
            _PTR,                  # ssm pool (fp32)
            _PTR, _PTR, _I64, _I64,  # q, k, their token and channel strides
            _PTR, _I64, _I64,      # v, its token and channel strides
            _PTR, _PTR,            # g [T, Hv] fp32, beta [T, Hv]
            _PTR,                  # out [T, Hv, Dv]
            _I64, _I64, _I64, _I64, _INT,  # Hk, Hv, Dk, Dv, l2norm
            _I64, _PTR, _PTR, _PTR,  # K snapshots: segment, offset, slot (by segment, offset)
        ],
    },
    "attention_decode": {
        "attention_decode": [
            _I64, _I64, _I64, _I64, _I64,  # B, Hq, Hkv, D, Dv
            _PTR,                  # q
            _PTR, _PTR,            # k pool, v pool
            _PTR, _I64,            # slot table, its row stride
            _PTR, _PTR,            # begin, end of the own keys
            _PTR, _PTR, _PTR,      # shared out, shared lse, shared row (nullable)
            _PTR, _I64,            # row groups' offsets [G+1] (nullable: a row each), G
            ctypes.c_float,        # scale
            _PTR,                  # out
        ],
    },
    "attention_prefill": {
        "attention_prefill_bf16": [
            _I64, _PTR, _PTR,      # P, cu [P+1] (token rows), prefix [P]
            _PTR, _PTR,            # kv_cu [P+1], slots (every request's keys, concatenated)
            _I64, _I64, _I64, _I64,  # Hq, Hkv, D, Dv
            _PTR, _I64,            # q [T, Hq, D], its token row stride
            _PTR, _PTR,            # k pool, v pool
            ctypes.c_float,        # scale
            _PTR, _PTR, _I64,      # gather buffers: keys, value pairs, keys per KV head (Lp)
            _PTR,                  # out [T, Hq, Dv]
        ],
        "attention_prefill_supported": [],
        "attention_prefill_block": [],
    },
    "moe": {
        "moe_pad": [
            _I64, _I64, _I64, _I64,  # T, K, E, H
            _PTR, _I64,            # x, its row stride
            _PTR,                  # ids
            _PTR, _PTR,            # buf [E, T, H], pos (out)
        ],
        "moe_unpad": [
            _I64, _I64, _I64,      # T, K, H
            _PTR, _I64,            # y, floats between expert blocks
            _PTR, _PTR, _PTR,      # ids, pos, weights
            _PTR,                  # out
        ],
    },
    "sampling": {
        "argmax_logsumexp": [
            _I64, _I64,            # B rows, V logits a row
            _PTR, _I64,            # logits (fp32), their row stride
            _PTR,                  # out: index [B] (int64)
            _PTR, _PTR,            # out: max [B], log(sum(exp(x - max))) [B] (fp32)
            _INT,                  # whether to compute the last two
        ],
    },
    "linear_fp8": {
        "linear_fp8": [
            _I64, _I64, _I64,      # M, N, K
            _PTR, _I64,            # x (bf16), its row stride
            _PTR, _PTR, _PTR,      # codes [N, K] (e4m3), block scales (fp32), bias (nullable)
            _PTR,                  # out [M, N] (bf16)
            _PTR, _PTR,            # the e4m3 magnitudes' bf16 high and low bytes [128] each
            _PTR,                  # scratch: M x K (rounded up to 64) bf16
        ],
        "dequantize_fp8": [
            _I64, _I64,            # N, K
            _PTR, _PTR,            # codes, block scales
            _PTR, _PTR,            # the tables
            _PTR,                  # out [N, K] (bf16)
        ],
        "linear_fp8_supported": [],
        "moe_experts_fp8": [
            _I64, _I64, _I64, _I64, _I64,  # T, K, E, I, H
            _INT,                  # gated
            _PTR, _I64,            # x (bf16), its row stride
            _PTR, _PTR,            # ids [T, K] (int64), weights [T, K] (fp32)
            _PTR, _PTR,            # up / gate_up codes [E, U, H], their scales
            _PTR, _PTR,            # down codes [E, H, I], their scales
            _PTR, _PTR,            # the tables
            _PTR, _PTR, _PTR, _PTR, _PTR,  # scratch: xs, gu, h, y, xp (bf16)
            _PTR,                  # scratch: idx (int64)
            _PTR,                  # out [T, H] (bf16)
        ],
    },
    "linear": {
        "linear_bf16": [
            _I64, _I64, _I64,      # M, N, K
            _PTR, _I64,            # x, its row stride
            _PTR, _PTR,            # weight [N, K], bias (nullable)
            _PTR,                  # out [M, N]
        ],
        "linear_bf16_many": [
            _I64, _I64, _I64,      # M, N, K
            _PTR, _I64,            # x, its row stride
            _PTR, _PTR,            # weight [N, K], bias (nullable)
            _PTR,                  # out [M, N]
            _PTR,                  # scratch: M x K (rounded up to 32) fp32
        ],
        "gated_mlp_bf16": [
            _I64, _I64, _I64,      # M rows, I (intermediate), H (hidden)
            _PTR, _I64,            # x, its row stride
            _PTR, _PTR,            # gate_up [2I, H], down [H, I]
            _PTR, _PTR,            # scratch: gate|up [M, 2I], act(gate) * up [M, I]
            _PTR,                  # out [M, H]
            _PTR,                  # NULL (few rows) or scratch: M x max(H, I) (rounded up) fp32
        ],
        "moe_experts_bf16": [
            _I64, _I64, _I64,      # T tokens, K experts a token, E experts
            _I64, _I64,            # I (an expert's intermediate), H (hidden)
            _INT,                  # gated (silu(gate) * up), else relu(up)^2
            _PTR, _I64,            # x [T, H], its row stride
            _PTR, _PTR,            # ids [T, K] int64, weights [T, K] fp32
            _PTR, _PTR,            # gate_up [E, 2I, H] (or up [E, I, H]), down [E, H, I]
            _PTR, _PTR, _PTR, _PTR,  # scratch: rows [P, H], gate|up [P, 2I], [P, I], [P, H]
            _PTR,                  # scratch: 2P + 2E + 1 int64 (P = T * K)
            _PTR,                  # out [T, H]
        ],
        "linear_uses_dpbf16": [],
        "linear_uses_f32x": [],
        "linear_rows_blocked": [_INT],  # tests: 1 / 0 force K blocks on / off, -1 auto
        "linear_amx": [_INT],  # 0: AMX tiles off, else on where granted; returns whether on
        "linear_uses_amx": [],
    },
    "rms_norm": {
        "rms_norm": [
            _I64, _I64,            # rows, dim
            _PTR, _I64,            # x, its row stride
            _PTR, ctypes.c_float, _INT,  # weight, eps, zero-centred
            _PTR,                  # out
        ],
        "add_rms_norm": [
            _I64, _I64,            # rows, dim
            _PTR, _I64,            # x, its row stride
            _PTR, _I64,            # residual, its row stride
            ctypes.c_float, _INT,  # scale, whether to multiply by it
            _PTR, ctypes.c_float, _INT,  # weight, eps, zero-centred
            _PTR, _PTR,            # h out, normed out (both dense)
        ],
        "rms_norm_rope": [
            _I64, _I64, _I64,      # T, H, D
            _PTR, _I64, _I64,      # x, its token and head strides
            _PTR, ctypes.c_float, _INT,  # weight, eps, zero-centred
            _PTR, _PTR, _I64,      # cos, sin, rotary dim
            _PTR,                  # out
        ],
        "rms_norm_gate_first": [
            _I64, _I64, _I64,      # rows, group size, groups
            _PTR, _I64,            # x, its row stride
            _PTR, _I64,            # silu(gate), its row stride
            _PTR, ctypes.c_float,  # weight, eps
            _PTR,                  # out
        ],
        "rms_norm_gated": [
            _I64, _I64,            # rows, dim
            _PTR, _I64,            # x, its row stride
            _PTR, _I64,            # silu(gate), its row stride
            _PTR, ctypes.c_float,  # weight, eps
            _PTR,                  # out
        ],
    },
}  # fmt: skip

# The bf16 twins take the same arguments (bf16 data behind the same pointers).
for _lib, _name in (
    ("rms_norm", "rms_norm"),
    ("rms_norm", "add_rms_norm"),
    ("rms_norm", "rms_norm_gated"),
    ("rms_norm", "rms_norm_gate_first"),
    ("rms_norm", "rms_norm_rope"),
    ("gated_delta_decode", "gated_delta_decode"),
    ("attention_decode", "attention_decode"),  # bf16 pools; q, shared piece and out fp32
    ("moe", "moe_pad"),
    ("ssm_decode", "conv1d_update"),
    ("ssm_decode", "mamba2_step"),  # bf16 x, B, C, D; the state, dt and y fp32
    ("ssm_decode", "mamba2_decode"),  # bf16 inputs, parameters and y; the state fp32
    ("ssm_decode", "mamba2_scan"),  # bf16 x, B, C, D; the state, dt and y fp32
    ("conv_prefill", "conv1d_prefill"),
    ("gated_delta_scan", "gated_delta_scan"),  # bf16 q, k, v, beta, out; the state and g fp32
):
    SIGNATURES[_lib][_name + "_bf16"] = SIGNATURES[_lib][_name]
SIGNATURES["moe"]["moe_unpad_bf16"] = [*SIGNATURES["moe"]["moe_unpad"], _INT]  # + out is bf16
# functions that return a value (the others return nothing)
RESULTS = {
    "moe_pad": _I64,
    "moe_pad_bf16": _I64,
    "linear_uses_dpbf16": _INT,
    "linear_fp8_supported": _INT,
    "linear_uses_f32x": _INT,
    "attention_prefill_supported": _INT,
    "attention_prefill_block": _INT,
    "linear_rows_blocked": _INT,
    "linear_amx": _INT,
    "linear_uses_amx": _INT,
}
RESULTS.update({f"{scan}{v}": _INT for scan in ("mamba2_scan", "gated_delta_scan", "conv1d_prefill")
                for v in ("", "_bf16")})  # fmt: skip
# of those, the ones whose value depends on the data (a recorded step that calls one cannot be
# replayed: Python read what the call returned); linear_uses_dpbf16 describes the build
DATA_RESULTS = frozenset(RESULTS) - {
    "linear_uses_dpbf16",
    "linear_fp8_supported",
    "attention_prefill_supported",
    "attention_prefill_block",
    "linear_uses_f32x",
    "linear_rows_blocked",
    "linear_amx",
    "linear_uses_amx",
}


def cache_dir() -> Path:
    env = os.environ.get("MAMBARADIX_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mambaradix" / "kernels"


def _uses_libgomp() -> bool:
    path = openmp_runtime_path()
    return path is not None and "libgomp" in Path(path).name


_origins: dict[str, str] = {}  # library -> "prebuilt" | "cache" | "compiled"
_compiled: set[str] = set()  # libraries this process tried to compile (tried once only)


def origins() -> dict[str, str]:
    """Where each library loaded so far came from: ``"prebuilt"`` (built when the package was
    installed), ``"cache"`` (compiled by an earlier process) or ``"compiled"`` (by this one)."""
    return dict(_origins)


@dataclass(frozen=True, slots=True)
class _Build:
    cc: str
    flags: list[str]
    version: str

    def path(self, directory: Path, name: str) -> Path:
        key = native_build.library_key(name, self.flags, self.version)
        return native_build.library_file(directory, name, key)


@functools.cache
def _build_setup() -> _Build | None:
    cc = native_build.compiler()
    if cc is None:
        logger.warning("no C compiler found ($CC or cc): native kernels not built")
        return None
    version = native_build.compiler_version(cc)
    if version is None:
        logger.warning("C compiler %s unusable: native kernels not built", cc)
        return None
    return _Build(cc, native_build.flags(openmp=_uses_libgomp()), version)


def _find(build: _Build, name: str) -> tuple[Path, str] | None:
    for directory, origin in ((native_build.PREBUILT, "prebuilt"), (cache_dir(), "cache")):
        path = build.path(directory, name)
        if path.exists():
            return path, origin
    return None


def _compile(build: _Build, names: list[str]) -> None:
    """Compile the libraries neither the install nor an earlier process built, at once, into
    the cache (a source tree never installed, or sources edited since)."""
    started = time.perf_counter()
    _compiled.update(names)
    outputs = {name: build.path(cache_dir(), name) for name in names}
    failed = native_build.compile_libraries(build.cc, build.flags, outputs)
    for name, err in failed.items():
        logger.warning("building native kernel %s failed:\n%s", name, err)
    if built := [name for name in names if name not in failed]:
        logger.info("built native kernels in %.1f s (%s; an install builds them beforehand)",
                    time.perf_counter() - started, ", ".join(built))  # fmt: skip


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The built library ``csrc/<name>.c`` with its functions' argtypes set, or None when it
    cannot be built here (reason logged once). Prebuilt at install time, else compiled by an
    earlier process, else compiled now."""
    build = _build_setup()
    if build is None:
        return None
    found = _find(build, name)
    if found is None and name not in _compiled:
        _compile(build, [name])
        found = _find(build, name)
    if found is None:
        return None
    path, origin = found
    if name in _compiled:
        origin = "compiled"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("loading native kernel %s failed: %s", name, e)
        return None
    for fn, argtypes in SIGNATURES.get(name, {}).items():
        getattr(lib, fn).argtypes = argtypes
        getattr(lib, fn).restype = RESULTS.get(fn)
    _origins[name] = origin
    logger.debug("native kernel %s: %s (%s)", name, path, origin)
    return lib


def available() -> bool:
    """Whether every native kernel builds and loads here. Compiles the missing ones at once
    (one compiler per core) before loading them one by one."""
    build = _build_setup()
    if build is None:
        return False
    missing = [n for n in SIGNATURES if n not in _compiled and _find(build, n) is None]
    if missing:
        _compile(build, missing)
    return all(load(name) is not None for name in SIGNATURES)


# ------------------------------------------------------------------ recording calls


@dataclass(slots=True)
class NativeCall:
    """One call of an exported C function: ``function(*args)`` (the ctypes function itself,
    argtypes set), with the positions of its pointer arguments."""

    name: str
    function: ctypes._CFuncPtr
    args: tuple
    pointers: tuple[int, ...]


_thread = threading.local()  # .calls: the list the current thread records into, if any
_install_lock = threading.Lock()
_installed: list[tuple[ctypes.CDLL, str, object]] = []  # (library, name, original function)
_recorders = 0


def _recorded(name: str, function, pointers: tuple[int, ...]):
    def call(*args):
        calls = getattr(_thread, "calls", None)
        if calls is not None:
            calls.append(NativeCall(name, function, args, pointers))
        return function(*args)

    return call


@contextlib.contextmanager
def recording() -> Iterator[list[NativeCall]]:
    """Every native call this thread makes inside the block, in order (other threads' calls
    pass through unrecorded). While any thread records, each exported function is wrapped;
    the originals are put back when the last recording ends."""
    global _recorders
    with _install_lock:
        if _recorders == 0:
            for lib_name, functions in SIGNATURES.items():
                lib = load(lib_name)
                for fn in functions if lib is not None else ():
                    original = getattr(lib, fn)
                    ptrs = tuple(i for i, t in enumerate(functions[fn]) if t is _PTR)
                    _installed.append((lib, fn, original))
                    setattr(lib, fn, _recorded(fn, original, ptrs))
        _recorders += 1
    calls: list[NativeCall] = []
    outer = getattr(_thread, "calls", None)
    _thread.calls = calls
    try:
        yield calls
    finally:
        _thread.calls = outer
        with _install_lock:
            _recorders -= 1
            if _recorders == 0:
                for lib, fn, original in _installed:
                    setattr(lib, fn, original)
                _installed.clear()
