"""fp8 weights (``--quantization fp8``, ``kernels/fp8.py``): the block quantizer, the C kernels
against the reference, the loader storing the weights quantized as they load, and models whose
outputs are those of the same model with the dequantized weights.

Tolerances: the C kernel sums each 128-column block's exact products in fp32 and scales the
block sum; the reference dequantizes (exactly: the scales are powers of two) and runs the
dense linear. The two differ in the order of the fp32 sums and by the output's rounding to
bf16 (2^-9 relative): ``REL_TOL`` 8e-3 of the output's largest magnitude (against an fp32
reference). Measured: 2-3e-3. Negative controls: scales applied to the wrong blocks, and the
tables with the sign bit ignored, fail it."""

from __future__ import annotations

import pytest
import torch

from mambaradix.kernels import cpu, fp8
from mambaradix.kernels.backend import backend_names, create_backend
from mambaradix.kernels.fp8 import BLOCK, E4M3_MAX, Fp8Weight

REL_TOL = 8e-3

needs_native = pytest.mark.skipif(
    fp8._native() is None,
    reason="the fp8 C kernel needs AVX-512 BF16 and VBMI (and a C compiler): the reference ran",
)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[: min(n, BLOCK), : min(k, BLOCK)] *= 40  # blocks of very different scales
    return w.to(torch.bfloat16)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# ------------------------------------------------------------------ the quantizer


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (7, 64)])
def test_quantize_round_trip_is_within_e4m3_precision(shape):
    w = _weight(*shape).float()
    q, scale = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.shape == (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
    back = fp8.dequantize(q, scale, torch.float32)
    s = scale.repeat_interleave(BLOCK, 0)[: shape[0]].repeat_interleave(BLOCK, 1)[:, : shape[1]]
    # e4m3: 3 mantissa bits (half a step 2^-4 relative) for normals; subnormal steps of 2^-9
    bound = torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10)
    assert ((back - w).abs() <= bound + 1e-12).all()
    codes = q.float()
    assert not codes.isnan().any()
    # scales are powers of two, the smallest that fit each block (its largest code 224-448)
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = codes[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            assert E4M3_MAX / 2 < block.abs().max() <= E4M3_MAX
    # so a code times its scale is exact in bf16: every path computes with the same weights
    assert torch.equal(fp8.dequantize(q, scale, torch.bfloat16).float(), back)


def test_an_all_zero_block_has_scale_one_and_zero_codes():
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, scale = fp8.quantize(w)
    assert scale[0, 0] == 1.0 and (q[:, :128].float() == 0).all()
    assert scale[0, 1] == 2.0**-8 and (q[:, 128:].float() == 256).all()  # 1/448 -> 2^-8


def test_fp8_weight_checks_its_parts():
    q, scale = fp8.quantize(torch.randn(130, 64))
    with pytest.raises(ValueError, match="scales"):
        Fp8Weight(q, scale[:1, :])
    with pytest.raises(TypeError, match="float8"):
        Fp8Weight(q.float(), scale)


def test_the_tables_hold_every_e4m3_magnitude_exactly_in_bf16():
    hi, lo = fp8.lut()
    bits = (hi.to(torch.int32) << 8 | lo.to(torch.int32)).to(torch.int16).view(torch.bfloat16)
    want = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(bits[:127].float(), want)  # subnormals included: bf16 holds them normal
    assert bits[1].float() == 2.0**-9 and bits[126].float() == E4M3_MAX


# ------------------------------------------------------------------ the C kernels


@needs_native
@pytest.mark.parametrize("n,k", [(512, 1024), (300, 192), (1000, 3584), (129, 64), (96, 100),
                                 (70, 32)])  # fmt: skip (the last two: a masked last chunk)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 32])
def test_native_linear_matches_the_reference(n, k, m):
    w = Fp8Weight.from_dense(_weight(n, k, seed=n + k))
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16)[:, ::2]  # strided rows
    x = torch.randn(m, k, generator=g).to(torch.bfloat16) if m % 2 else x.contiguous()
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    want = fp8.linear(x.float(), w, bias.float())
    got = cpu.linear(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert _rel_err(got, want) < REL_TOL
    # a row's result never depends on the rest of the batch
    assert torch.equal(cpu.linear(x[-1:], w, bias), got[-1:])
    assert torch.equal(cpu.linear(x, w, None), cpu.linear(x, w, None))  # and is deterministic


@needs_native
def test_native_linear_controls_fail():
    """The checks above catch a kernel that applies the scales to the wrong blocks or loses
    the sign."""
    n, k = 256, 512
    w = Fp8Weight.from_dense(_weight(n, k))
    x = torch.randn(2, k).to(torch.bfloat16)
    want = fp8.linear(x.float(), w, None)
    assert _rel_err(cpu.linear(x, w, None), want) < REL_TOL
    wrong_blocks = Fp8Weight(w.q, w.scale.flip(1).contiguous())
    assert _rel_err(cpu.linear(x, wrong_blocks, None), want) > 10 * REL_TOL
    unsigned = Fp8Weight((w.q.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn), w.scale)
    assert _rel_err(cpu.linear(x, unsigned, None), want) > 10 * REL_TOL


@needs_native
def test_many_rows_dequantize_to_the_references_bf16_weights():
    for n, k in [(384, 320), (130, 100), (3, 7)]:  # whole vectors, and a scalar tail
        w = Fp8Weight.from_dense(_weight(n, k))
        assert torch.equal(fp8._dequantize_native(w), w.dequantize(torch.bfloat16)), (n, k)
    # every code (signs, subnormals, zeros; 127 and 255 are NaN) under non-power-of-two scales
    codes = torch.arange(256, dtype=torch.uint8).repeat(3, 1)
    codes[codes % 128 == 127] = 0
    w = Fp8Weight(codes.view(torch.float8_e4m3fn).contiguous(), torch.tensor([[0.3, 1.7]]))
    assert torch.equal(fp8._dequantize_native(w), w.dequantize(torch.bfloat16))
    w = Fp8Weight.from_dense(_weight(384, 320))
    x = torch.randn(fp8.NATIVE_MAX_ROWS + 7, 320).to(torch.bfloat16)
    assert not fp8.native_rows(x.shape[0], 320)
    assert torch.equal(cpu.linear(x, w, None), cpu.linear(x, w.dequantize(torch.bfloat16), None))


def test_fp32_takes_the_reference():
    w = Fp8Weight.from_dense(_weight(64, 96))
    x = torch.randn(3, 96)
    assert torch.equal(cpu.linear(x, w, None), fp8.linear(x, w, None))  # fp32: exact


# ------------------------------------------------------------------ loading and models


def prefill_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Every position's logits of one prompt through fresh pools."""
    from mambaradix.cache.kv_pool import KVPool
    from mambaradix.cache.state_pool import StatePool
    from mambaradix.core import ForwardReq
    from mambaradix.layout import ForwardContext

    kv, states = KVPool(model.kv_spec, 256), StatePool(model.state_spec, 2)
    slots = kv.alloc(len(ids))
    (slot,) = states.alloc(1)
    states.clear([slot])
    req = ForwardReq(0, ids.tolist(), slots, slot, [])
    with torch.no_grad():
        return model(ForwardContext.build([req], kv, states), all_logits=True)


def _dense_twin(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every Fp8Weight replaced by its dequantized weight (the reference)."""
    import copy

    twin = copy.deepcopy(model)
    for mod in list(twin.modules()):
        for leaf, child in list(mod.named_children()):
            if isinstance(child, Fp8Weight):  # a linear's weight, or a stack of experts'
                dense = child.dequantize(torch.float32)  # (the fp32 models below)
                delattr(mod, leaf)
                setattr(mod, leaf, torch.nn.Parameter(dense, requires_grad=False))
    return twin


@pytest.mark.parametrize("arch", ["qwen3_next", "granite_hybrid_moe", "lfm2", "falcon_h1"])
def test_loading_quantizes_every_linear_but_the_head_and_routers(arch):
    from mambaradix.layers.ops import Linear
    from mambaradix.models.loader import load_model

    model = load_model(f"tiny:{arch}", quantization="fp8")
    dense = load_model(f"tiny:{arch}")
    quantized, kept = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear):
            (quantized if isinstance(mod.weight, Fp8Weight) else kept).append(name)
    assert quantized
    assert all(n.endswith(("lm_head", "router.layer", "shared_expert_gate")) for n in kept), kept
    # the routed experts' stacks too, expert by expert
    stacks = [(n, leaf) for n, m in model.named_modules() if hasattr(m, "expert_stacks")
              for leaf in m.expert_stacks()]  # fmt: skip
    assert bool(stacks) == (arch == "granite_hybrid_moe" or arch == "qwen3_next"), stacks
    for name, leaf in stacks:
        stack = getattr(model.get_submodule(name), leaf)
        w = getattr(dense.get_submodule(name), leaf).float()
        assert isinstance(stack, Fp8Weight) and stack.q.dim() == 3 and stack.scale.dim() == 3
        back = stack.dequantize(torch.float32)
        assert (back - w).abs().max() <= w.abs().max() * 2.0**-4 + 1e-9, name
        assert torch.equal(stack[1].dequantize(torch.float32), back[1])
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)
    # quantized from the checkpoint's weights: its dequantized weights are within e4m3 of them
    dense_mods = dict(dense.named_modules())
    for name in quantized:
        w = dense_mods[name].weight.float()
        back = dict(model.named_modules())[name].weight.dequantize(torch.float32)
        assert (back - w).abs().max() <= w.abs().max() * 2.0**-4 + 1e-9, name
        assert w.abs().max() > 0
    state = model.state_dict()
    assert any(k.endswith("weight.q") and v.dtype == torch.float8_e4m3fn for k, v in state.items())


def test_a_tied_head_and_unknown_methods():
    from mambaradix.models.loader import load_model

    model = load_model("tiny:qwen3_5", quantization="fp8")
    if model.tie_word_embeddings:
        assert model.lm_head.weight is model.embedding.weight
    with pytest.raises(ValueError, match="fp8"):
        load_model("tiny:qwen3_5", quantization="int4")


@pytest.mark.parametrize("arch", ["qwen3_next", "granite_hybrid", "lfm2", "granite_hybrid_moe",
                                  "lfm2_moe", "nemotron_h"])  # fmt: skip
def test_fp8_model_equals_its_dequantized_twin_fp32(arch):
    """fp32: the fp8 model's logits are exactly those of the same model with the dequantized
    weights (the reference dequantizes exactly), and differ from the checkpoint's own."""
    from mambaradix.models.loader import load_model

    model = load_model(f"tiny:{arch}", quantization="fp8")
    twin = _dense_twin(model)
    dense = load_model(f"tiny:{arch}")
    ids = torch.randint(3, model.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    got, want, orig = (prefill_logits(m, ids) for m in (model, twin, dense))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert (got - orig).abs().max() > 1e-3  # the control: quantization changed the model


# ------------------------------------------------------------------ published FP8 checkpoints


def _published_fp8(folder, block=(128, 128), drop_scale=False):
    """tiny:granite_hybrid rewritten as the published FP8 checkpoints are: every projection's
    weight as e4m3 codes with an fp32 ``weight_scale_inv`` per 128 x 128 block (scales are the
    blocks' amax / 448, not powers of two), ``quantization_config`` in config.json. Returns the
    folder and a copy written with the dequantized weights in fp32 (the reference)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from mambaradix.models.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint("granite_hybrid", str(folder / "src"))
    fp8_dir, ref_dir = folder / "fp8", folder / "dequantized"
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
    (file,) = list(fp8_dir.glob("*.safetensors"))
    tensors = load_file(str(file))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") or name.endswith("linear.weight"):
            w = t.float()
            nb, kb = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
            padded = torch.nn.functional.pad(w, (0, kb * BLOCK - w.shape[1], 0,
                                                 nb * BLOCK - w.shape[0]))  # fmt: skip
            amax = padded.view(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3))
            scale = (amax / E4M3_MAX).clamp(min=1e-12)
            s = scale.repeat_interleave(BLOCK, 0)[: w.shape[0]].repeat_interleave(BLOCK, 1)
            codes = (w / s[:, : w.shape[1]]).to(torch.float8_e4m3fn)
            quantized[name] = codes
            if not drop_scale:
                quantized[name + "_scale_inv"] = scale
            dequantized[name] = fp8.dequantize(codes, scale, torch.float32)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, str(file), metadata={"format": "pt"})
    save_file(dequantized, str(ref_dir / file.name), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic"}  # fmt: skip
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, ref_dir


def test_a_published_fp8_checkpoint_loads_dequantized_or_as_fp8(tmp_path):
    from mambaradix.models.loader import load_model

    fp8_dir, ref_dir = _published_fp8(tmp_path)
    ref = load_model(str(ref_dir))
    ids = torch.randint(3, ref.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    want = prefill_logits(ref, ids)
    # dense: the checkpoint's values exactly (codes times scales, in fp32)
    dense = load_model(str(fp8_dir), quantization="none")
    assert not any(isinstance(m, Fp8Weight) for m in dense.modules())
    assert torch.equal(prefill_logits(dense, ids), want)
    # by default as fp8: the checkpoint's values quantized again to power-of-two block scales
    model = load_model(str(fp8_dir))
    ref_mods = dict(ref.named_modules())
    requantized = [(n, m.weight) for n, m in model.named_modules()
                   if isinstance(getattr(m, "weight", None), Fp8Weight)]  # fmt: skip
    assert requantized
    for name, w in requantized:
        orig = ref_mods[name].weight.float()
        step = torch.maximum(orig.abs() * 2.0**-4, w.scale.max() * 2.0**-10)
        assert ((w.dequantize(torch.float32) - orig).abs() <= step).all(), name
    # the same model as the checkpoint's values quantized from a dense checkpoint
    got = prefill_logits(model, ids)
    assert torch.equal(got, prefill_logits(load_model(str(ref_dir), quantization="fp8"), ids))
    assert not torch.equal(got, want)  # the control: requantizing rounds


def test_published_fp8_checkpoints_that_do_not_fit_are_refused(tmp_path):
    from mambaradix.models.loader import load_model
    from mambaradix.models.weights import CheckpointError

    fp8_dir, _ = _published_fp8(tmp_path / "a", block=(64, 64))
    with pytest.raises(CheckpointError, match="weight_block_size"):
        load_model(str(fp8_dir))
    fp8_dir, _ = _published_fp8(tmp_path / "b", drop_scale=True)
    with pytest.raises(CheckpointError, match="_scale_inv"):
        load_model(str(fp8_dir))


# ------------------------------------------------------------------ every backend


@pytest.mark.parametrize("name", sorted(backend_names()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 40])
def test_every_backends_linear_and_gated_mlp_take_fp8_weights(name, dtype, m):
    """The op contract's ``linear`` and ``gated_mlp`` with ``Fp8Weight``s, on every registered
    backend (the cuda backend's on CPU tensors: the reference it inherits), against the
    reference: exact in fp32, within ``REL_TOL`` in bf16."""
    backend = create_backend(name)
    h, i = 256, 384
    gate_up, down = (
        Fp8Weight.from_dense(_weight(2 * i, h, 1)),
        Fp8Weight.from_dense(_weight(h, i, 2)),
    )
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(m)).to(dtype)
    want = fp8.linear(x.float(), gate_up, None)
    got = backend.linear(x, gate_up, None)
    assert got.dtype == dtype and got.shape == (m, 2 * i)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    assert _rel_err(got, want) < REL_TOL
    g, u = want.chunk(2, dim=-1)
    want_mlp = fp8.linear((torch.nn.functional.silu(g) * u).to(dtype).float(), down, None)
    got_mlp = backend.gated_mlp(x, gate_up, down, "silu")
    assert _rel_err(got_mlp, want_mlp) < 2 * REL_TOL


def test_the_storage_tiers_fingerprint_tells_fp8_weights_from_dense():
    """Stored KV and states of the dense model are not those of its fp8 version: the tier's
    model fingerprint (cache/storage/keys.py) must differ, so one never loads the other's."""
    from mambaradix.cache.storage.keys import model_fingerprint
    from mambaradix.models.loader import load_model

    fps = []
    for quant in ("none", "fp8", "fp8"):
        model = load_model("tiny:qwen3_5", quantization=quant)
        fps.append(model_fingerprint(model, model.kv_spec, model.state_spec, block=64,
                                     page_size=1))  # fmt: skip
    assert fps[0] != fps[1] and fps[1] == fps[2]


@pytest.mark.parametrize("name", sorted(backend_names()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_every_backends_moe_experts_take_fp8_stacks(name, dtype, tokens):
    """``moe_experts`` with fp8 expert stacks: each routed pair through its expert's fp8
    linears (the reference dequantizes them), against the op on the dequantized stacks."""
    backend = create_backend(name)
    e, h, i, k = 8, 256, 192, 2
    g = torch.Generator().manual_seed(tokens)
    gate_up = Fp8Weight.from_dense(torch.randn(e, 2 * i, h, generator=g) * 0.05)
    down = Fp8Weight.from_dense(torch.randn(e, h, i, generator=g) * 0.05)
    x = torch.randn(tokens, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).to(dtype)
    got = backend.moe_experts(x, weights, ids, gate_up, down, "silu")
    want = create_backend("torch").moe_experts(
        x.float(), weights.float(), ids, gate_up.dequantize(torch.float32),
        down.dequantize(torch.float32), "silu",
    )  # fmt: skip
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert _rel_err(got, want) < 3 * REL_TOL
    if name == "cpu" and dtype == torch.bfloat16 and tokens < 70 and fp8._native() is not None:
        # a decode batch took the one C call (moe_experts_fp8), not the per-expert loop
        one_call = fp8.moe_experts_cpu(x, weights, ids, gate_up, down, "silu", True, 64)
        assert one_call is not None and torch.equal(one_call, got)
        # control: the same call with the experts' ids shifted by one is far off
        wrong = fp8.moe_experts_cpu(x, weights, (ids + 1) % e, gate_up, down, "silu", True, 64)
        assert _rel_err(wrong, want) > 10 * REL_TOL


@needs_native
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "relu2"])
def test_the_fp8_moe_call_equals_the_per_expert_loop(gated):
    """The one C call against the reference's loop over the same fp8 experts (each expert's
    linears through the CPU backend: the same kernel), a plain relu² block too (Nemotron-H)."""
    backend = create_backend("cpu")
    e, h, i, k, tokens = 16, 512, 256, 4, 6
    g = torch.Generator().manual_seed(7)
    up = Fp8Weight.from_dense(torch.randn(e, (2 if gated else 1) * i, h, generator=g) * 0.05)
    down = Fp8Weight.from_dense(torch.randn(e, h, i, generator=g) * 0.05)
    x = torch.randn(tokens, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).to(torch.bfloat16)
    act = "silu" if gated else "relu2"
    one_call = fp8.moe_experts_cpu(x, weights, ids, up, down, act, gated, 1 << 10)
    from mambaradix.kernels import moe
    from mambaradix.kernels.activation import activation

    loop = moe.moe_experts(backend, x, weights, ids, up, down, activation(act), 0, gated)
    assert one_call is not None
    assert _rel_err(one_call, loop) < REL_TOL  # (the sums' roundings differ: fp32 vs bf16)
