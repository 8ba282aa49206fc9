"""The ``"cpu"`` backend: the torch reference with native C primitives (``kernels.cpu``) for
the decode hot spots and the per-token ops. Each primitive falls back to the reference for
inputs its C code does not cover, so this backend gives the reference's results everywhere.

Decodes of several positions (a verify step, ``layout.DecodeRows``) run in the same C calls as
one-position decodes: each request's positions stepped in order inside its tasks, the state
after each written into its position's slot (``csrc/decode.h``)."""

from __future__ import annotations

from mambaradix.kernels import cpu, fp8, moe, native
from mambaradix.kernels.activation import activation
from mambaradix.kernels.backend import register_backend
from mambaradix.kernels.torch_backend import TorchBackend, _copy_decode_snapshots


@register_backend("cpu")
class CpuBackend(TorchBackend):
    gated_delta_step = staticmethod(cpu.gated_delta_decode)
    attention_decode = staticmethod(cpu.attention_decode)
    linear = staticmethod(cpu.linear)
    rms_norm = staticmethod(cpu.rms_norm)
    add_rms_norm = staticmethod(cpu.add_rms_norm)
    rms_norm_gated = staticmethod(cpu.rms_norm_gated)
    rms_norm_gate_first = staticmethod(cpu.rms_norm_gate_first)
    rms_norm_rope = staticmethod(cpu.rms_norm_rope)
    moe_pad = staticmethod(cpu.moe_pad)
    moe_unpad = staticmethod(cpu.moe_unpad)
    steps_positions = True

    @classmethod
    def available(cls) -> bool:
        """Whether the native kernels built here (else every op runs the reference)."""
        return native.available()

    @classmethod
    def unavailable_reason(cls) -> str:
        return "no C compiler or a failed build of the native kernels: the log says which"

    @classmethod
    def fast_bf16_on_cpu(cls) -> bool:
        """Also where the native linear kernels compute bf16 rows in SIMD registers without
        bf16 instructions (AVX2): decode reads half the bytes and prefill takes fp32 matmuls
        either way (on an AVX2-only EPYC, bf16 decoded Qwen3.5-0.8B 2.9x and Granite-4.0-H-350M
        3.3x faster than fp32 at batch 1, prefill as fast: docs/benchmarks.md)."""
        return super().fast_bf16_on_cpu() or cpu.bf16_linear_kernels()

    def native_ops(self) -> list[str]:
        return [
            "gdn_prefill", "gdn_decode", "paged_attention_decode",
            "paged_attention_prefill (bf16, AVX-512 BF16)", "conv1d_prefill",
            "conv1d_decode", "mamba2_prefill", "mamba2_decode", "mamba2_mixer_decode",
            "linear (bf16, decode)", "gated_mlp (bf16, decode)", "rms_norm", "add_rms_norm",
            "rms_norm_gated", "rms_norm_gate_first", "rms_norm_rope", "moe_pad", "moe_unpad",
            "moe_experts (bf16, decode)",
        ]  # fmt: skip

    def paged_attention_prefill(self, q, k_pool, v_pool, layout, scale):
        """Every request in one C call where the kernel applies (bf16 pools, AVX-512 BF16):
        no cascade needed (each request's keys gathered once per call, every query's result
        its own whatever the chunk or batch); else the reference's cascades."""
        out = None
        if cpu.attention_prefill_fits(q, k_pool, v_pool):
            keys = self._index(layout).get(
                ("prefill_keys",), lambda: cpu.PrefillKeys.of(layout.prefill)
            )
            out = cpu.attention_prefill(q, k_pool, v_pool, keys, scale)
        if out is None:
            return super().paged_attention_prefill(q, k_pool, v_pool, layout, scale)
        return out

    def paged_attention_decode(self, q, k_pool, v_pool, layout, scale):
        """A verify step's rows of a request read its keys once together (``row_groups``)."""
        dec = layout.decode
        if not dec.multi:
            return super().paged_attention_decode(q, k_pool, v_pool, layout, scale)
        plan = self._decode_attention_plan(layout, k_pool.shape[1])
        groups = self._row_groups(layout, k_pool.shape[1])
        return cpu.attention_decode(
            q, k_pool, v_pool, dec.kv_table, dec.seq_lens, scale, plan, groups
        )

    def _row_groups(self, layout, heads: int):
        """``cpu.verify_row_groups`` of the decodes of several positions, once per forward."""
        dec = layout.decode
        return self._index(layout).get(
            ("row_groups", heads),
            lambda: cpu.verify_row_groups(
                dec.cu, dec.kv_table, dec.seq_lens, self._decode_attention_plan(layout, heads).begin
            ),
        )

    def replay_key(self, layout, num_kv_heads):
        """The reference's, and for decodes of several positions whether their rows read
        their keys by request (computed here, before a recording: it reads the table)."""
        key = super().replay_key(layout, num_kv_heads)
        dec = layout.decode
        if key is None or not dec.multi or dec.kv_table is None or not num_kv_heads:
            return key
        return (key, self._row_groups(layout, num_kv_heads) is not None)

    def write_replay_inputs(self, recorded, layout) -> None:
        super().write_replay_inputs(recorded, layout)
        for key, groups in self._index(layout)._memo.items():
            if key[0] == "row_groups" and groups is not None:
                self._index(recorded)._memo[key].copy_(groups)

    def moe_experts(self, x, weights, ids, gate_up, down, act, gated=True):
        """bf16 decode batches in one C call that reads only the routed experts' weights; other
        batches of fewer pairs than experts (fp32 decodes) by the reference's per-expert loop,
        which reads only theirs too (Granite-4.0-H-tiny's shape, fp32, batch 1: 29.1 -> 3.6 ms
        a layer); the rest by the reference."""
        out = cpu.moe_experts(x, weights, ids, gate_up, down, act, gated)
        if out is None:  # fp8 stacks: their C call for as many pairs as the bf16 one takes
            pairs = cpu.MOE_NATIVE_PAIRS_PER_EXPERT * gate_up.shape[0]
            out = fp8.moe_experts_cpu(x, weights, ids, gate_up, down, act, gated, pairs)
        if out is not None:
            return out
        few = gate_up.shape[0]  # the padded GEMM from as many pairs as experts
        return moe.moe_experts(self, x, weights, ids, gate_up, down, activation(act), few, gated)

    def gated_mlp(self, x, gate_up, down, act):
        if isinstance(gate_up, fp8.Fp8Weight) or isinstance(down, fp8.Fp8Weight):
            return super().gated_mlp(x, gate_up, down, act)  # two fp8 linears around the gate
        out = cpu.gated_mlp(x, gate_up, down, act)
        return super().gated_mlp(x, gate_up, down, act) if out is None else out

    def conv1d_decode(self, x, weight, bias, conv_pool, layout, activation):
        dec = layout.decode
        y = cpu.conv1d_update(
            x, conv_pool, dec.state_slots, weight, bias, activation, dec.cu, dec.row_slots
        )
        if y is None:
            return super().conv1d_decode(x, weight, bias, conv_pool, layout, activation)
        _copy_decode_snapshots(conv_pool, dec)
        return y

    def _segments(self, layout) -> cpu.ScanSegments:
        """The prefill segments as the native prefill kernels take them, once per forward."""
        return self._index(layout).get(
            ("scan_segments",), lambda: cpu.ScanSegments.of(layout.prefill)
        )

    def conv1d_prefill(self, x, weight, bias, conv_pool, layout, activation):
        y = cpu.conv1d_prefill(x, conv_pool, self._segments(layout), weight, bias, activation)
        if y is None:
            return super().conv1d_prefill(x, weight, bias, conv_pool, layout, activation)
        return y

    def gdn_prefill(self, q, k, v, g, beta, ssm_pool, layout):
        out = cpu.gated_delta_scan(ssm_pool, self._segments(layout), q, k, v, g, beta)
        if out is None:
            return super().gdn_prefill(q, k, v, g, beta, ssm_pool, layout)
        return out

    def mamba2_prefill(self, x, dt, A, B, C, D, ssm_pool, layout):
        y = cpu.mamba2_scan(ssm_pool, self._segments(layout), x, dt, A, B, C, D)
        if y is None:
            return super().mamba2_prefill(x, dt, A, B, C, D, ssm_pool, layout)
        return y

    def mamba2_decode(self, x, dt, A, B, C, D, ssm_pool, layout):
        dec = layout.decode
        y = cpu.mamba2_step(ssm_pool, dec.state_slots, x, dt, A, B, C, D, dec.cu, dec.row_slots)
        if y is None:
            return super().mamba2_decode(x, dt, A, B, C, D, ssm_pool, layout)
        _copy_decode_snapshots(ssm_pool, dec)
        return y

    def gdn_decode(self, x, a, b, conv_pool, ssm_pool, layout, conv_weight, conv_bias, A_log,
                   dt_bias, num_k_heads, activation, norm=None, beta_scale=1.0):  # fmt: skip
        dec = layout.decode
        out = cpu.gated_delta_decode(
            x, conv_pool, ssm_pool, dec.state_slots, conv_weight, conv_bias, a, b, A_log,
            dt_bias, num_k_heads, activation, out_norm=norm, cu=dec.cu, row_slots=dec.row_slots,
            beta_scale=beta_scale,
        )  # fmt: skip
        if out is None:  # several positions the C code does not cover: stepped one by one
            return super().gdn_decode(
                x, a, b, conv_pool, ssm_pool, layout, conv_weight, conv_bias, A_log, dt_bias,
                num_k_heads, activation, norm, beta_scale,
            )  # fmt: skip
        for pool in (conv_pool, ssm_pool):
            _copy_decode_snapshots(pool, dec)
        return out

    def mamba2_mixer_decode(self, xbc, dt_raw, conv_pool, ssm_pool, layout, conv_weight,
                            conv_bias, activation, A_log, dt_bias, dt_limit, D, shape,
                            norm=None):  # fmt: skip
        dec = layout.decode
        y = cpu.mamba2_decode(
            xbc, dt_raw, conv_pool, ssm_pool, dec.state_slots, conv_weight, conv_bias,
            activation, A_log, dt_bias, dt_limit, D, shape, out_norm=norm, cu=dec.cu,
            row_slots=dec.row_slots,
        )  # fmt: skip
        if y is None:  # the composition of this backend's conv and scan steps
            return super().mamba2_mixer_decode(
                xbc, dt_raw, conv_pool, ssm_pool, layout, conv_weight, conv_bias, activation,
                A_log, dt_bias, dt_limit, D, shape, norm,
            )  # fmt: skip
        for pool in (conv_pool, ssm_pool):
            _copy_decode_snapshots(pool, dec)
        return y
