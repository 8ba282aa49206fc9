"""transformers on a CPU: its own torch path for Gated DeltaNet, whatever is installed.

transformers takes fla-core's Triton kernels for Gated DeltaNet wherever ``fla`` imports (the
test extra installs it for the cuda backend's tests); on a CPU those kernels cannot run (no
Triton driver) or run interpreted. The tests' oracle (on any device) and the CPU benchmarks'
comparison call ``use_torch_path()`` before transformers builds a model (its modeling modules
choose the kernels when they are imported); the GPU benchmark leaves fla-core to transformers,
as users run it.
"""

from __future__ import annotations

import importlib.util

_done = False


def use_torch_path() -> None:
    """Make transformers' hub-kernel lookups for ``fla`` return the torch function."""
    global _done
    if _done or importlib.util.find_spec("fla") is None:
        return
    import transformers.integrations as integrations
    import transformers.integrations.hub_kernels as hub_kernels

    with_fallback = hub_kernels.use_kernel_func_from_hub_with_fallback

    def without_fla(func_name: str, package: str, internal_path: str | None = None):
        if package == "fla":
            return lambda torch_function: torch_function
        return with_fallback(func_name, package, internal_path)

    hub_kernels.use_kernel_func_from_hub_with_fallback = without_fla
    integrations.use_kernel_func_from_hub_with_fallback = without_fla
    _done = True
