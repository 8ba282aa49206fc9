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
  interpreter scalars.

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

    def __call__(self, *args, **kwargs):
        module_globals = self.fn.__globals__
        before = module_globals.get("range", _MISSING)
        module_globals["range"] = interpreter_range
        try:
            return run_kernel(self, *args, **kwargs)
        finally:
            if before is _MISSING:
                module_globals.pop("range", None)
            else:
                module_globals["range"] = before

    interpreter.GridExecutor.__call__ = __call__
    _INSTALLED = True


_MISSING = object()
