"""The ``"cuda"`` backend: Triton kernels for the state ops and the paged attention, over pools
on the GPU (docs/backends.md).

- Gated DeltaNet: fla-core's chunked gated delta rule (varlen, states by slot) for prefills and
  its recurrent step for decodes (``kernels/triton/gdn.py``);
- the short conv, the Mamba2 scan and paged attention: this project's Triton kernels
  (``kernels/triton/conv.py``, ``mamba2.py``, ``attention.py``);
- a mixture of experts' routed part: a grouped GEMM over blocks of one expert's pairs
  (``kernels/triton/moe.py``), so only the routed experts' weights are read;
- projections and norms: torch (cuBLAS and fused elementwise kernels).

``prepare`` builds every index tensor the kernels take (int32 ``cu_seqlens``, state slots,
snapshot indices, the prefills' KV slot table) once per forward (``CudaIndex``); the layers' ops
never copy between host and device nor read a device value.

Snapshots inside a prefill come from the chunked kernels' chunk-boundary states, so
``capabilities.snapshot_stride`` is their chunk (64): the planner ends a forward where a wanted
snapshot falls between chunk boundaries.

Decodes of several positions (a verify step) run in the decode kernels too: a program walks its
request's rows, storing the state after each into that row's slot (``DecodeIndex.cu`` /
``row_slots``), each position starting from the state the one before stored, as one-position
steps would; no per-position index is built on the host. The decode attention takes them as one
query row per position.

On a machine without a GPU the same kernels run on CPU tensors under ``TRITON_INTERPRET=1``
(the tests: ``tests/triton``); ``available()`` says so.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from mambaradix.kernels import fp8, gated_delta
from mambaradix.kernels.activation import activation
from mambaradix.kernels.backend import register_backend
from mambaradix.kernels.capabilities import BackendCapabilities
from mambaradix.kernels.torch_backend import TorchBackend, TorchIndex, _copy_decode_snapshots
from mambaradix.layout import ForwardLayout, to_device

Tensor = torch.Tensor
CHUNK = 64  # fla-core's chunk: where its prefill kernels keep states
H200_MULTIPROCESSORS = 132


def unavailable_reason() -> str | None:
    """Why the ``cuda`` backend cannot run here, or None."""
    missing = [m for m in ("triton", "fla") if importlib.util.find_spec(m) is None]
    if missing:
        names = {"triton": "triton", "fla": "fla-core"}
        return f"{', '.join(names[m] for m in missing)} not installed (pip install -e '.[cuda]')"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the kernels run on CPU tensors, interpreted (tests)
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return None


def _int32(values: list[int], device: torch.device) -> Tensor:
    return to_device(torch.tensor(values, dtype=torch.int32), device)


@dataclass(slots=True)
class PrefillIndex:
    """The prefill segments as the Triton kernels take them."""

    cu_seqlens: Tensor  # int32 [P+1]
    prefix_lens: Tensor  # int32 [P]
    state_slots: Tensor  # int32 [P]
    snap_seqs: Tensor  # int32 [S]
    snap_offsets: Tensor  # int32 [S]
    snap_slots: Tensor  # int32 [S]
    snap_chunks: Tensor  # int64 [S]: each snapshot's chunk in fla-core's varlen numbering
    gdn_chunks: object  # gdn.GdnChunks: that numbering on the device
    kv_table: Tensor | None  # int32 [P, L]: every segment's KV slots (prefix and new)
    max_len: int  # the longest segment's new tokens


@dataclass(slots=True)
class DecodeIndex:
    state_slots: Tensor  # int32 [D] (one per decode request)
    kv_table: Tensor | None  # int32 [Td, L]
    seq_lens: Tensor  # int32 [Td]
    cu: Tensor | None  # int32 [D+1]: each request's first row (a verify step's), else None
    row_slots: Tensor | None  # int32 [Td]: the slot of the state after each row, else None


class CudaIndex(TorchIndex):
    """The per-forward index tensors of the Triton kernels (and the reference's memo, for the
    ops this backend takes from it)."""

    __slots__ = ("prefill", "decode")

    def __init__(self, layout: ForwardLayout, backend: CudaBackend) -> None:
        super().__init__(layout, backend)
        dev = layout.device
        self.prefill: PrefillIndex | None = None
        self.decode: DecodeIndex | None = None
        seg = layout.prefill
        if seg is not None:
            from mambaradix.kernels.triton import gdn

            kv_table = None
            if seg.kv_slots:
                kv_table = torch.nn.utils.rnn.pad_sequence(
                    seg.kv_slots, batch_first=True, padding_value=0
                ).to(torch.int32)
            self.prefill = PrefillIndex(
                cu_seqlens=seg.cu_seqlens.to(torch.int32),
                prefix_lens=_int32(seg.prefix_lens, dev),
                state_slots=seg.state_slots.to(torch.int32),
                snap_seqs=_int32(seg.snapshot_seqs, dev),
                snap_offsets=_int32(seg.snapshot_offsets, dev),
                snap_slots=seg.snapshot_slots.to(torch.int32),
                snap_chunks=to_device(
                    torch.tensor(
                        [
                            gdn.snapshot_index(seg.lens, s, n)
                            for s, n in zip(seg.snapshot_seqs, seg.snapshot_offsets)
                        ],
                        dtype=torch.long,
                    ),
                    dev,
                ),  # fmt: skip
                gdn_chunks=gdn.GdnChunks.build(seg.lens, dev),
                kv_table=kv_table,
                max_len=max(seg.lens),
            )
        dec = layout.decode
        if dec is not None:
            self.decode = DecodeIndex(
                state_slots=dec.state_slots.to(torch.int32),
                kv_table=None if dec.kv_table is None else dec.kv_table.to(torch.int32),
                seq_lens=dec.seq_lens.to(torch.int32),
                cu=None if dec.cu is None else dec.cu.to(torch.int32),
                row_slots=None if dec.row_slots is None else dec.row_slots.to(torch.int32),
            )


@register_backend("cuda")
class CudaBackend(TorchBackend):
    capabilities = BackendCapabilities(snapshot_stride=CHUNK)
    # the Mamba2 prefill's form: None picks per forward (``triton/mamba2_chunked.py``'s
    # ``prefers_chunked``), True the fully parallel one, False the sequential one (tests and
    # the device benchmark set it)
    mamba2_chunked: bool | None = None
    _sm_count: int | None = None

    def _multiprocessors(self) -> int:
        if self._sm_count is None:
            dev = torch.device(self.device)
            self._sm_count = (
                torch.cuda.get_device_properties(dev).multi_processor_count
                if dev.type == "cuda"
                else H200_MULTIPROCESSORS  # interpreted: as on the GPU the project targets
            )
        return self._sm_count

    @classmethod
    def available(cls) -> bool:
        return unavailable_reason() is None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return unavailable_reason()

    def native_ops(self) -> list[str]:
        return [
            "paged_attention_prefill", "paged_attention_decode", "conv1d_prefill",
            "conv1d_decode", "gdn_prefill (fla-core)", "gdn_decode (fla-core)",
            "mamba2_prefill", "mamba2_decode", "mamba2_mixer_decode", "moe_experts",
        ]  # fmt: skip

    def prepare(self, layout: ForwardLayout) -> None:
        layout.meta = CudaIndex(layout, self)

    # ------------------------------------------------------------------ attention

    def paged_attention_prefill(self, q, k_pool, v_pool, layout, scale) -> Tensor:
        from mambaradix.kernels.triton import attention

        idx = self._index(layout).prefill
        return attention.paged_attention_prefill(
            q, k_pool, v_pool, idx.cu_seqlens, idx.prefix_lens, idx.kv_table, scale, idx.max_len
        )

    def paged_attention_decode(self, q, k_pool, v_pool, layout, scale) -> Tensor:
        from mambaradix.kernels.triton import attention

        idx = self._index(layout).decode
        return attention.paged_attention_decode(
            q, k_pool, v_pool, idx.kv_table, idx.seq_lens, scale
        )

    def replay_key(self, layout, num_kv_heads):
        return None  # CUDA graphs replay this backend's steps (engine/cuda_graphs.py)

    # ------------------------------------------------------------------ conv

    def conv1d_prefill(self, x, weight, bias, conv_pool, layout, activation) -> Tensor:
        from mambaradix.kernels.triton import conv

        idx = self._index(layout).prefill
        return conv.conv1d_prefill(
            x, weight, bias, conv_pool, idx.cu_seqlens, idx.state_slots, idx.snap_seqs,
            idx.snap_offsets, idx.snap_slots, activation,
        )  # fmt: skip

    def conv1d_decode(self, x, weight, bias, conv_pool, layout, activation) -> Tensor:
        from mambaradix.kernels.triton import conv

        idx = self._index(layout).decode
        y = conv.conv1d_decode(x, weight, bias, conv_pool, idx.state_slots, activation, idx.cu,
                               idx.row_slots)  # fmt: skip
        _copy_decode_snapshots(conv_pool, layout.decode)
        return y

    # ------------------------------------------------------------------ Gated DeltaNet

    def gdn_prefill(self, q, k, v, g, beta, ssm_pool, layout) -> Tensor:
        from mambaradix.kernels.triton import gdn

        seg, idx = layout.prefill, self._index(layout).prefill
        return gdn.gdn_prefill(
            q, k, v, g, beta, ssm_pool, idx.cu_seqlens, seg.state_slots, idx.snap_chunks,
            seg.snapshot_slots, idx.gdn_chunks,
        )  # fmt: skip

    def gdn_decode(self, x, a, b, conv_pool, ssm_pool, layout, conv_weight, conv_bias, A_log,
                   dt_bias, num_k_heads, activation, norm=None,
                   beta_scale=1.0) -> Tensor:  # fmt: skip
        """The conv step, the gates, the delta step on the pool (fla-core's; a verify step's
        positions in this project's kernel), the output norm."""
        from mambaradix.kernels.triton import conv, gdn

        dec, idx = layout.decode, self._index(layout).decode
        hv, dk, dv = ssm_pool.shape[1:]
        n = x.shape[0]
        mixed = conv.conv1d_decode(x, conv_weight, conv_bias, conv_pool, idx.state_slots,
                                   activation, idx.cu, idx.row_slots)  # fmt: skip
        q, k, v = torch.split(mixed, [num_k_heads * dk, num_k_heads * dk, hv * dv], dim=-1)
        g, beta = gated_delta.gdn_gates(a, b, A_log, dt_bias, beta_scale)
        q, k, v = q.reshape(n, num_k_heads, dk), k.reshape(n, num_k_heads, dk), v.reshape(n, hv, dv)
        if dec.multi:
            out = gdn.gdn_decode_positions(q, k, v, g, beta, ssm_pool, idx.state_slots, idx.cu,
                                           idx.row_slots)  # fmt: skip
        else:
            out = gdn.gdn_decode(q, k, v, g, beta, ssm_pool, idx.state_slots)
        for pool in (conv_pool, ssm_pool):
            _copy_decode_snapshots(pool, dec)
        if norm is None:
            return out
        return self.rms_norm_gated(out, norm.gate.reshape(out.shape), norm.weight, norm.eps)

    # ------------------------------------------------------------------ Mamba2

    def mamba2_prefill(self, x, dt, A, B, C, D, ssm_pool, layout) -> Tensor:
        from mambaradix.kernels.triton import mamba2 as triton_mamba2
        from mambaradix.kernels.triton import mamba2_chunked as triton_chunked

        idx = self._index(layout).prefill
        chunked = self.mamba2_chunked
        if chunked is None:  # host integers only: the shapes of this forward's index tensors
            chunked = triton_chunked.prefers_chunked(
                idx.cu_seqlens.shape[0] - 1, idx.gdn_chunks.indices.shape[0], x.shape[1],
                x.shape[2], B.shape[2], self._multiprocessors(),
            )  # fmt: skip
        if chunked:
            return triton_chunked.mamba2_prefill_chunked(
                x, dt, A, B, C, D, ssm_pool, idx.cu_seqlens, idx.state_slots, idx.snap_chunks,
                layout.prefill.snapshot_slots, idx.gdn_chunks.indices, idx.gdn_chunks.offsets,
            )  # fmt: skip
        return triton_mamba2.mamba2_prefill(
            x, dt, A, B, C, D, ssm_pool, idx.cu_seqlens, idx.state_slots, idx.snap_seqs,
            idx.snap_offsets, idx.snap_slots,
        )  # fmt: skip

    def mamba2_decode(self, x, dt, A, B, C, D, ssm_pool, layout) -> Tensor:
        from mambaradix.kernels.triton import mamba2 as triton_mamba2

        idx = self._index(layout).decode
        y = triton_mamba2.mamba2_decode(x, dt, A, B, C, D, ssm_pool, idx.state_slots, idx.cu,
                                        idx.row_slots)  # fmt: skip
        _copy_decode_snapshots(ssm_pool, layout.decode)
        return y

    # ------------------------------------------------------------------ mixture of experts

    def moe_experts(self, x, weights, ids, gate_up, down, act, gated=True) -> Tensor:
        """Each pair's row through its own expert only, with no host sync
        (``kernels/triton/moe.py``; the reference reads every expert and the padding's size)."""
        from mambaradix.kernels.triton import moe as triton_moe

        if isinstance(gate_up, fp8.Fp8Weight) or isinstance(down, fp8.Fp8Weight):
            return super().moe_experts(x, weights, ids, gate_up, down, act, gated)  # reference
        return triton_moe.moe_experts(x, weights, ids, gate_up, down, activation(act), gated)

    # mamba2_mixer_decode: the reference's composition of this backend's conv and scan steps
