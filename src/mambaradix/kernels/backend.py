"""The kernel-backend contract: what a backend must do, and the one registry of backends.

A backend is an object the engine owns (two engines in one process may use different ones). The
model is bound to it once (``HybridCausalLM.use_backend``); the runner calls ``prepare(layout)``
once per forward, where the backend builds its own per-forward tensors (index tensors, device
copies) into ``layout.meta``. Layers then call the ops below with their activations and pools;
every op reads the batch's structure from the layout, never rebuilds it.

State ops (conv, Gated DeltaNet, Mamba2) read each request's state from its working slot in the
pool and write back the state after its new tokens; for every snapshot the layout lists they
also write the state after that many new tokens into the snapshot slot. Prefill ops take the
prefill part of the batch (``layout.prefill``: varlen segments, ``cu_seqlens``), decode ops
the decode part (``layout.decode``: one token per request, or a verify step's few positions,
stepped in order, the state after each into its own slot: ``DecodeRows``; the reference runs
its one-position step position after position, ``TorchBackend._stepwise``).

Shapes use one vocabulary: ``T`` tokens of the forward, ``Tp`` the prefills' tokens, ``Td`` the
decodes' rows (one per decode, one per position of a verify step), ``Dh`` / ``Dv`` an attention
head's key / value size, ``Dk`` / ``Dv`` a Gated DeltaNet head's. ``D`` is only Mamba2's skip
parameter ``[H]`` (its published name, like ``A``, ``B``, ``C``).

``capabilities`` tells the planner what the backend can do (``BackendCapabilities``). The
``torch`` backend is the reference: every other backend passes the contract tests against it
(``tests/models/test_backend_contract.py``; ``docs/backends.md``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from typing import ClassVar, TypeVar

import torch

from mambaradix.kernels.capabilities import BackendCapabilities
from mambaradix.kernels.norm import GatedNorm
from mambaradix.layout import ForwardLayout

Tensor = torch.Tensor


class KernelBackend(ABC):
    name: ClassVar[str]
    capabilities: BackendCapabilities = BackendCapabilities()

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    @classmethod
    def available(cls) -> bool:
        """Whether this backend's kernels can run here (e.g. they built)."""
        return True

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why ``available()`` is false (the log may say more)."""
        return "see the log"

    @classmethod
    def fast_bf16_on_cpu(cls) -> bool:
        """Whether this backend computes a bf16 model on this CPU at least about as fast as an
        fp32 one (``--dtype auto`` keeps a bf16 checkpoint in bf16 where it does, else computes
        in fp32): here, where torch's bf16 matmul runs in hardware."""
        from mambaradix.kernels.cpu_features import fast_bf16_matmul

        return fast_bf16_matmul()

    def native_ops(self) -> list[str]:
        """The ops this backend runs in its own code rather than the torch reference's."""
        return []

    @abstractmethod
    def prepare(self, layout: ForwardLayout) -> None:
        """Build this backend's per-forward tensors into ``layout.meta``."""

    def replay_key(self, layout: ForwardLayout, num_kv_heads: int) -> Hashable | None:
        """Whether a decode forward over ``layout`` (prepared) may be recorded and replayed
        (``engine.step_graph``), and with which recording: the backend builds now every
        per-forward tensor it would build inside the forward (none may be built while a step is
        recorded) and returns the structure of those tensors that shapes the forward (the
        reference: its decode attention plan's; two steps with the same key and batch replay
        one recording), or None where it cannot be replayed.
        ``num_kv_heads``: the KV pool's heads (0 without attention). Default: None."""
        return None

    def write_replay_inputs(self, recorded: ForwardLayout, layout: ForwardLayout) -> None:
        """Copy the per-forward tensors ``replay_key`` built for ``layout`` into those it built
        for ``recorded`` (a step of the same key), before that recording is replayed. Default:
        nothing (none built)."""
        return None

    # ------------------------------------------------------------ attention over the KV pool
    @abstractmethod
    def store_kv(self, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor,
                 layout: ForwardLayout) -> None:  # fmt: skip
        """Write the new tokens' ``k``/``v`` ``[T, Hkv, Dh]`` at ``layout.out_kv_slots``."""

    @abstractmethod
    def paged_attention_prefill(self, q: Tensor, k_pool: Tensor, v_pool: Tensor,
                                layout: ForwardLayout, scale: float) -> Tensor:  # fmt: skip
        """Causal attention of the prefill queries ``q`` ``[Tp, Hq, Dh]`` (segments as in
        ``layout.prefill``) over each segment's keys ``kv_slots[p]`` (already stored).
        Returns ``[Tp, Hq, Dv]``."""

    @abstractmethod
    def paged_attention_decode(self, q: Tensor, k_pool: Tensor, v_pool: Tensor,
                               layout: ForwardLayout, scale: float) -> Tensor:  # fmt: skip
        """One query per decode row ``q`` ``[Td, Hq, Dh]`` over ``kv_table[r, :seq_lens[r]]``
        (a verify step's rows: its keys up to each one's own token)."""

    # ------------------------------------------------------------ causal depthwise conv
    @abstractmethod
    def conv1d_prefill(self, x: Tensor, weight: Tensor, bias: Tensor | None, conv_pool: Tensor,
                       layout: ForwardLayout, activation: str | None) -> Tensor:  # fmt: skip
        """Conv over the prefill segments ``x`` ``[Tp, C]`` (weight ``[C, K]``) carrying the
        conv state ``[C, K-1]`` (the last K-1 inputs) from and to each segment's slot, and
        into its snapshot slots. Returns ``[Tp, C]`` (activated)."""

    @abstractmethod
    def conv1d_decode(self, x: Tensor, weight: Tensor, bias: Tensor | None, conv_pool: Tensor,
                      layout: ForwardLayout, activation: str | None) -> Tensor:  # fmt: skip
        """One conv step per decode row ``x`` ``[Td, C]``, states updated in the pool (a verify
        step's positions in order, each one's state into its row slot)."""

    # ------------------------------------------------------------ Gated DeltaNet
    @abstractmethod
    def gdn_prefill(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    ssm_pool: Tensor, layout: ForwardLayout) -> Tensor:  # fmt: skip
        """Chunked gated delta rule over the prefill segments (q, k ``[Tp, Hk, Dk]`` after the
        conv, v ``[Tp, Hv, Dv]``, g / beta ``[Tp, Hv]``; q, k L2-normalised inside), the delta
        state ``[Hv, Dk, Dv]`` from and to each segment's slot and into its snapshot slots.
        Returns ``[Tp, Hv, Dv]``."""

    @abstractmethod
    def gdn_decode(self, x: Tensor, a: Tensor, b: Tensor, conv_pool: Tensor, ssm_pool: Tensor,
                   layout: ForwardLayout, conv_weight: Tensor, conv_bias: Tensor | None,
                   A_log: Tensor, dt_bias: Tensor, num_k_heads: int, activation: str | None,
                   norm: GatedNorm | None = None, beta_scale: float = 1.0) -> Tensor:  # fmt: skip
        """One fused decode step of the decodes (``x`` ``[Td, conv_dim]`` = q|k|v before the
        conv, ``a`` / ``b`` ``[Td, Hv]`` raw gates): conv, gates (``gdn_gates``, with
        ``beta_scale``), delta rule; both states updated in the pool. Returns ``[Td, Hv, Dv]``;
        with ``norm`` (gate ``[Td, Hv * Dv]``, ``group_size`` Dv), the layer's output norm of it
        (``rms_norm_gated`` per head)."""

    # ------------------------------------------------------------ Mamba2
    @abstractmethod
    def mamba2_prefill(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                       D: Tensor | None, ssm_pool: Tensor,
                       layout: ForwardLayout) -> Tensor:  # fmt: skip
        """Chunked selective scan over the prefill segments (``x`` ``[Tp, H, P]``, ``dt``
        ``[Tp, H]`` processed, ``B``/``C`` ``[Tp, G, N]``), state ``[H, P, N]`` from and to each
        segment's slot and into its snapshot slots. Returns ``[Tp, H, P]`` fp32."""

    @abstractmethod
    def mamba2_decode(self, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                      D: Tensor | None, ssm_pool: Tensor,
                      layout: ForwardLayout) -> Tensor:  # fmt: skip
        """One scan step of the decodes; returns ``[Td, H, P]`` fp32."""

    @abstractmethod
    def mamba2_mixer_decode(self, xbc: Tensor, dt_raw: Tensor, conv_pool: Tensor,
                            ssm_pool: Tensor, layout: ForwardLayout, conv_weight: Tensor,
                            conv_bias: Tensor | None, activation: str | None, A_log: Tensor,
                            dt_bias: Tensor, dt_limit: tuple[float, float], D: Tensor | None,
                            shape: tuple[int, int, int, int],
                            norm: GatedNorm | None = None) -> Tensor:  # fmt: skip
        """One fused decode step of the decodes (``xbc`` ``[Td, C]`` before the conv, ``dt_raw``
        ``[Td, H]`` before softplus; ``shape`` = ``(H, P, G, N)``): conv, dt, scan; both states
        updated in the pool. Returns ``[Td, H, P]`` in ``xbc``'s dtype; with ``norm`` (gate
        ``[Td, H * P]``), the mixer's output norm of it ``[Td, H * P]`` (``rms_norm_gate_first``
        per group), or with a ``norm`` without weight the bare gate (``norm.silu_gate``)."""

    # ------------------------------------------------------------ per-token ops
    @abstractmethod
    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``x @ weight.T + bias`` (``nn.Linear``: weight ``[out, in]``), in ``x``'s dtype."""

    @abstractmethod
    def gated_mlp(self, x: Tensor, gate_up: Tensor, down: Tensor, act: str) -> Tensor:
        """A gated feed-forward block without biases: ``[gate | up] = linear(x, gate_up)``
        (``gate_up`` ``[2I, H]``, gate first), ``linear(act(gate) * up, down)`` (``down``
        ``[H, I]``); ``act`` a Hugging Face ``hidden_act`` name."""

    @abstractmethod
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
        """RMSNorm over the last dim (``zero_centered``: weight stored as an offset from 1)."""

    @abstractmethod
    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                     zero_centered: bool, scale: float = 1.0) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``h = residual + x * scale`` and ``rms_norm(h)``: returns ``(h, normed)``."""

    @abstractmethod
    def rms_norm_gated(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``weight * rms_norm(x) * silu(gate)``."""

    @abstractmethod
    def rms_norm_gate_first(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float,
                            group_size: int) -> Tensor:  # fmt: skip
        """``weight * rms_norm(x * silu(gate))``, each group of ``group_size`` on its own."""

    @abstractmethod
    def rms_norm_rope(self, x: Tensor, weight: Tensor, eps: float, zero_centered: bool,
                      cos: Tensor, sin: Tensor) -> Tensor:  # fmt: skip
        """Per-head RMSNorm of ``x`` ``[T, H, Dh]`` then rotate-half RoPE of its first
        ``cos.shape[-1]`` dims."""

    @abstractmethod
    def moe_pad(self, x: Tensor, ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
        """Lay the (token, expert) pairs out per expert: ``(buf [E, cap, H], pos [T*K])``."""

    @abstractmethod
    def moe_unpad(self, y: Tensor, ids: Tensor, pos: Tensor, weights: Tensor) -> Tensor:
        """Sum each token's expert outputs ``y`` ``[E, cap, H]`` by its routing weights."""

    @abstractmethod
    def moe_experts(self, x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor,
                    down: Tensor, act: str, gated: bool = True) -> Tensor:  # fmt: skip
        """A mixture of experts' routed part: ``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])``
        (``x`` ``[T, H]``, ``ids`` / ``weights`` ``[T, K]``), each expert a gated block as
        ``gated_mlp``'s (``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``, ``act`` a Hugging
        Face ``hidden_act`` name) or, not ``gated``, ``down(act(up(x)))`` (``gate_up`` then is
        ``up`` ``[E, I, H]``). The sum is at least as precise as the weights' and ``x``'s
        promoted dtype and is rounded once to ``x``'s."""


# --------------------------------------------------------------------------- the registry

B = TypeVar("B", bound=type[KernelBackend])

REFERENCE_BACKEND = "torch"
_BACKENDS: dict[str, type[KernelBackend]] = {}


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: make a backend available to ``create_backend`` by ``name``."""

    def deco(cls: B) -> B:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return deco


def _import_backends() -> None:
    from mambaradix.kernels import cpu_backend, cuda_backend, torch_backend  # noqa: F401


def backend_names() -> list[str]:
    _import_backends()
    return sorted(_BACKENDS)


def backend_class(name: str) -> type[KernelBackend]:
    _import_backends()
    if name not in _BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def create_backend(name: str, device: str | torch.device = "cpu") -> KernelBackend:
    """A new backend object of the registered class ``name`` for ``device``."""
    return backend_class(name)(device)


def choose_backend(name: str, device: str | torch.device) -> type[KernelBackend]:
    """The backend class for ``--kernel-backend name`` on ``device``: ``auto`` picks ``cuda`` on
    a CUDA device and ``cpu`` on a CPU one where their kernels can run, else the reference.
    Raises ValueError naming why when the named backend cannot run here."""
    kind = torch.device(device).type
    if name == "auto":
        preferred = {"cuda": "cuda", "cpu": "cpu"}.get(kind)
        if preferred is not None and backend_class(preferred).available():
            return backend_class(preferred)
        return backend_class(REFERENCE_BACKEND)
    cls = backend_class(name)
    if not cls.available():
        raise ValueError(
            f"--kernel-backend {name}: its kernels cannot run here ({cls.unavailable_reason()}); "
            "use --kernel-backend torch or auto"
        )
    return cls


def reference_backend() -> KernelBackend:
    """The torch reference on CPU: what a model runs on before an engine binds it."""
    global _REFERENCE
    if _REFERENCE is None:
        _REFERENCE = create_backend(REFERENCE_BACKEND)
    return _REFERENCE


_REFERENCE: KernelBackend | None = None
