"""How a layer reaches its kernel backend: ``self.ops``.

A module that calls kernel ops derives from ``KernelUser``. The model binds every such module
to the engine's backend once (``HybridCausalLM.use_backend``); before that, ``ops`` is the torch
reference on CPU, so a model built in a test runs as is.
"""

from __future__ import annotations

from torch import Tensor, nn

from mambaradix.kernels.backend import KernelBackend, reference_backend


class KernelUser:
    _ops: KernelBackend | None = None

    @property
    def ops(self) -> KernelBackend:
        return self._ops if self._ops is not None else reference_backend()

    def bind_ops(self, backend: KernelBackend) -> None:
        object.__setattr__(self, "_ops", backend)


class Linear(KernelUser, nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) through the backend's ``linear``:
    a decode step is mostly weight reads, and the backend decides how they are streamed.

    ``quantized_leaves`` (``("weight",)``, set before the weights load by
    ``loader.mark_quantized`` for ``--quantization fp8``): the weight is stored as an
    ``Fp8Weight`` as it loads (``weights.assign_weights``), and ``self.weight`` is that from
    then on. ``quantizable`` False keeps it dense (routers)."""

    quantized_leaves: tuple[str, ...] = ()
    quantizable: bool = True

    def forward(self, x: Tensor) -> Tensor:
        return self.ops.linear(x, self.weight, self.bias)
