"""Test-side shim for running the ``cuda`` backend's Triton kernels on CPU tensors under
``TRITON_INTERPRET=1`` (never imported by the product).

The interpreter runs a kernel's Python body with numpy arrays; three of its limits make a kernel
that is correct on a GPU fail or differ here, and each is patched or named:

- it cannot autotune (its benchmarker needs a GPU driver): ``Autotuner._bench`` returns equal
  timings, so the first config of every ``@triton.autotune`` list runs;
- ``int()`` of a scalar loaded from memory (``min(BC, T - i)`` where ``T`` came from
  ``cu_seqlens``) is a one-element array, which numpy >= 2 refuses to convert: ``__index__``
  reads its single element;
- a loop over Python ``range`` yields Python ints, where the compiler gives ``tl.int32``
  scalars (fla-core calls ``i_t.to(tl.int64)``): the kernels' modules get a ``range`` that yields
  interpreter scalars;
- (speed) a ``@triton.jit`` helper called inside a kernel re-patches the language on every
  call; inside a running kernel it is already patched, and the shim skips the repeat;
- bfloat16 values are numpy ``uint16`` bit patterns, and ``tl.dot``, the elementwise arithmetic
  (``+ - * /``, comparisons, ``exp``...) and ``fma`` ran on those raw bits (a bf16 ``tl.dot`` gave
  values ~1e9: fla-core's chunked kernels with bf16 inputs were garbage); ``fp32 -> bf16`` casts
  truncated where the GPU rounds to nearest even. bf16 operands are now widened to fp32 (exact),
  computed, and rounded back to bf16 to nearest even (one rounding of the fp32 result: a native
  bf16 add rounds the exact sum once, so the two can differ in the last bit, rarely).

Not emulated: TF32. On an Ampere-or-later GPU ``tl.dot`` on fp32 operands runs in TF32 by
default (fla-core also asks for it by name), so fp32 results there carry errors the interpreter's
exact fp32 matmuls do not show (fla's chunked GDN on an H200: ~1e-3 of the largest value).

``install()`` must run before the kernels' modules are imported (``TRITON_INTERPRET`` is read when
``@triton.jit`` decorates them).
"""

from __future__ import annotations

import builtins
import os

import torch

_INSTALLED = False


def wanted() -> bool:
    """Interpret where no GPU runs the kernels (this machine and CI)."""
    return not torch.cuda.is_available()


def install() -> None:
    global _INSTALLED
    if _INSTALLED or not wanted():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    autotuner.Autotuner._bench = lambda self, *args, config=None, **kwargs: [0.0, 0.0, 0.0]

    patch_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor

    def _scalar(i: int):
        handle = interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32)
        return tl.core.tensor(handle, tl.int32)

    class _Range:
        """``range`` inside interpreted kernels: ``tl.int32`` scalars, as compiled code sees."""

        def __call__(self, *args):
            ints = [int(a) for a in args]
            return (_scalar(i) for i in builtins.range(*ints))

    interpreter_range = _Range()
    run_kernel = interpreter.GridExecutor.__call__

    running = [0]  # kernels being interpreted (the language is patched while one runs)

    def __call__(self, *args, **kwargs):
        module_globals = self.fn.__globals__
        before = module_globals.get("range", _MISSING)
        module_globals["range"] = interpreter_range
        running[0] += 1
        patched.clear()
        try:
            return run_kernel(self, *args, **kwargs)
        finally:
            running[0] -= 1
            patched.clear()
            if before is _MISSING:
                module_globals.pop("range", None)
            else:
                module_globals["range"] = before

    interpreter.GridExecutor.__call__ = __call__

    patch_lang = interpreter._patch_lang
    patched: set[tuple[int, ...]] = set()  # the language modules patched in the running kernel

    def _patch_lang(fn):
        """Patch ``triton.language`` for ``fn`` unless the running kernel already patched the
        same modules (a ``@triton.jit`` helper re-patched them on every call)."""
        key = tuple(sorted(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core))
        if running[0] and key in patched:
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        patched.add(key)
        return scope

    interpreter._patch_lang = _patch_lang
    _patch_bfloat16(interpreter.InterpreterBuilder, interpreter.TensorHandle, tl, np)
    _INSTALLED = True


def _patch_bfloat16(builder, handle, tl, np) -> None:
    """bf16 arithmetic on values, not on the ``uint16`` bit patterns that hold them."""

    def widen(data):
        return (np.asarray(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

    def narrow(data):  # fp32 -> bf16 bits, round to nearest even (NaN stays NaN)
        bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(data), np.uint16(0x7FC0), rounded)

    def is_bf16(*handles) -> bool:
        return any(h.dtype.scalar == tl.bfloat16 for h in handles)

    def result(out, dtype):
        if out.dtype == np.float32:
            return handle(narrow(out), tl.bfloat16)
        return handle(out, dtype)  # comparisons: booleans, as the fp32 path returns them

    cast_impl = builder.cast_impl

    def _cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(narrow(src.data), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    create_dot = builder.create_dot

    def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if is_bf16(a, b):
            a = handle(widen(a.data), tl.float32)
            b = handle(widen(b.data), tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    binary_op = builder.binary_op

    def _binary_op(self, lhs, rhs, op):
        if not is_bf16(lhs, rhs):
            return binary_op(self, lhs, rhs, op)
        return result(op(widen(lhs.data), widen(rhs.data)), lhs.dtype.scalar)

    unary_op = builder.unary_op

    def _unary_op(self, arg, op):
        if not is_bf16(arg):
            return unary_op(self, arg, op)
        return result(op(widen(arg.data)), arg.dtype.scalar)

    create_fma = builder.create_fma

    def _create_fma(self, x, y, z):
        if not is_bf16(x, y, z):
            return create_fma(self, x, y, z)
        return result(widen(x.data) * widen(y.data) + widen(z.data), z.dtype.scalar)

    builder.cast_impl = _cast_impl
    builder.create_dot = _create_dot
    builder.binary_op = _binary_op
    builder.unary_op = _unary_op
    builder.create_fma = _create_fma


_MISSING = object()
