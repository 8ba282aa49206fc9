"""Loading without initialisation: no initialiser runs, dtypes (auto, bf16 / fp32 from a bf16
checkpoint), tied embeddings, nothing left on the meta device, peak RSS while loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from mambaradix.models.loader import checkpoint_dtype, load_model, resolve_dtype
from mambaradix.models.tiny import make_tiny_checkpoint
from mambaradix.models.weights import read_safetensors

TOKENS = list(range(3, 200, 7))


def logits(model) -> torch.Tensor:
    from mambaradix.cache.kv_pool import KVPool
    from mambaradix.cache.state_pool import StatePool
    from mambaradix.core import ForwardReq
    from mambaradix.layout import ForwardContext

    kv = KVPool(model.kv_spec, 64)
    st = StatePool(model.state_spec, 2)
    req = ForwardReq(0, TOKENS, torch.arange(len(TOKENS)), 0)
    return model(ForwardContext.build([req], kv, st), all_logits=True)


def to_bf16_checkpoint(src: Path, dst: Path) -> Path:
    """The checkpoint at ``src`` saved in bfloat16 (config.json says so, as transformers 5
    writes it)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = {k: v.to(torch.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(sd, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> Path:
    """Qwen3-Next with MoE: fused q/k/v, gate/up, GDN in_proj regrouping, per-expert stacks."""
    root = tmp_path_factory.mktemp("loading")
    make_tiny_checkpoint("qwen3_next", str(root / "fp32"), seed=5)
    to_bf16_checkpoint(root / "fp32", root / "bf16")
    return root


# --------------------------------------------------------------------------- initialisers

INIT_FNS = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]


@pytest.fixture
def initialisers_raise(monkeypatch):
    """Every torch.nn.init function and the tensor-level random fills raise."""

    def boom(*a, **k):
        raise AssertionError("an initialiser ran")

    for name in INIT_FNS:
        monkeypatch.setattr(torch.nn.init, name, boom)
    for name in ("uniform_", "normal_", "kaiming_uniform_"):
        if hasattr(torch.Tensor, name):
            monkeypatch.setattr(torch.Tensor, name, boom)


def test_no_initialiser_runs_while_loading(moe_ckpt, initialisers_raise):
    assert {"kaiming_uniform_", "normal_", "uniform_"} <= set(INIT_FNS)
    model = load_model(str(moe_ckpt / "fp32"))
    assert torch.isfinite(logits(model)).all()
    # negative control: building the same class the ordinary way does run them
    with pytest.raises(AssertionError, match="initialiser"):
        type(model)(model.config)


def test_meta_tensor_left_behind_is_an_error(moe_ckpt, monkeypatch):
    from mambaradix.layers.rotary import RotaryEmbedding

    orig = RotaryEmbedding.__init__

    def forgetful(self, *a, **k):
        orig(self, *a, **k)
        self.table = torch.zeros(4)  # default device: meta under no_init, never loaded

    monkeypatch.setattr(RotaryEmbedding, "__init__", forgetful)
    with pytest.raises(RuntimeError, match="rotary.table"):
        load_model(str(moe_ckpt / "fp32"))


def test_rotary_frequencies_are_computed_not_meta(moe_ckpt):
    model = load_model(str(moe_ckpt / "fp32"))
    inv = model.rotary.inv_freq
    d = model.rotary.rotary_dim
    theta = model.text_config.rope_parameters["rope_theta"]
    ref = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    assert not inv.is_meta and torch.equal(inv, ref)


# --------------------------------------------------------------------------- dtypes


def _write_config(folder: Path, cfg: dict) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", **cfg}))
    return str(folder)


def test_checkpoint_dtype_fields(tmp_path):
    assert checkpoint_dtype(_write_config(tmp_path / "a", {"dtype": "bfloat16"})) == torch.bfloat16
    assert checkpoint_dtype(_write_config(tmp_path / "b", {"torch_dtype": "float16"})) == (
        torch.float16
    )
    nested = _write_config(tmp_path / "c", {"text_config": {"dtype": "bfloat16"}})
    assert checkpoint_dtype(nested) == torch.bfloat16
    assert checkpoint_dtype(_write_config(tmp_path / "d", {})) == torch.float32
    assert resolve_dtype("auto", nested) == torch.bfloat16
    assert resolve_dtype("float32", nested) == torch.float32
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("int8", nested)


def test_auto_computes_bf16_checkpoints_in_fp32_without_bf16_hardware(moe_ckpt, monkeypatch):
    """On a CPU without bf16 matmuls (AVX2 only), auto takes float32 for a bf16 checkpoint;
    with them, bf16; an explicit --dtype bfloat16 is kept either way."""
    from mambaradix.kernels import cpu_features

    folder = moe_ckpt / "bf16"
    monkeypatch.setattr(cpu_features, "fast_bf16_matmul", lambda: False)
    assert next(load_model(str(folder)).parameters()).dtype == torch.float32
    assert next(load_model(str(folder), dtype="bfloat16").parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(cpu_features, "fast_bf16_matmul", lambda: True)
    assert next(load_model(str(folder)).parameters()).dtype == torch.bfloat16
    # the kernel backend's word (fast_bf16) decides over torch's matmul where it is given
    assert next(load_model(str(folder), fast_bf16=False).parameters()).dtype == torch.float32
    monkeypatch.setattr(cpu_features, "fast_bf16_matmul", lambda: False)
    assert next(load_model(str(folder), fast_bf16=True).parameters()).dtype == torch.bfloat16


def test_auto_keeps_bf16_where_the_native_kernels_compute_it(moe_ckpt, monkeypatch):
    """Without bf16 matmuls in hardware, an engine on the native CPU backend keeps a bf16
    checkpoint in bf16 where its linear kernels compute bf16 rows in SIMD registers (AVX2 and
    up: on an AVX2 EPYC bf16 decoded 2.9-3.3x faster than fp32, prefill as fast); on the torch
    backend (its bf16 matmul a scalar loop there) it computes in float32."""
    from mambaradix.engine.engine import Engine
    from mambaradix.kernels import cpu, cpu_features
    from mambaradix.kernels.cpu_backend import CpuBackend

    if not CpuBackend.available():
        pytest.skip("the native kernels did not build here")
    monkeypatch.setattr(cpu_features, "fast_bf16_matmul", lambda: False)
    folder = str(moe_ckpt / "bf16")
    opts = dict(skip_warmup=True, max_total_tokens=256, max_mamba_cache_size=4)
    with Engine(model_path=folder, kernel_backend="torch", **opts) as eng:
        assert eng.model.dtype == torch.float32
    if "avx2" in cpu_features.cpu_flags():
        assert cpu.bf16_linear_kernels()  # every x86 build with AVX2 has one of the two
    want = torch.bfloat16 if cpu.bf16_linear_kernels() else torch.float32
    with Engine(model_path=folder, kernel_backend="cpu", **opts) as eng:
        assert eng.model.dtype == want
    monkeypatch.setattr(cpu, "bf16_linear_kernels", lambda: False)  # a build without them
    with Engine(model_path=folder, kernel_backend="cpu", **opts) as eng:
        assert eng.model.dtype == torch.float32


def test_bf16_checkpoint_loads_as_bf16_by_default_with_checkpoint_values(moe_ckpt, monkeypatch):
    from mambaradix.kernels import cpu_features

    monkeypatch.setattr(cpu_features, "fast_bf16_matmul", lambda: True)  # bf16 hardware
    folder = moe_ckpt / "bf16"
    sd = dict(read_safetensors(folder / "model.safetensors"))
    model = load_model(str(folder))  # auto
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])
    layer = model.layers[3]  # an attention layer (full_attention_interval 2)
    assert layer.mixer_kind == "attn"
    qkv = torch.cat([sd[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    exp = layer.mlp.experts
    for e in (0, 5):
        gate_up = torch.cat(
            [sd[f"model.layers.3.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")]
        )
        assert torch.equal(exp.gate_up_proj[e], gate_up)
        assert torch.equal(exp.down_proj[e], sd[f"model.layers.3.mlp.experts.{e}.down_proj.weight"])
    # conv states follow the model dtype, temporal states stay float32 (--mamba-ssm-dtype)
    specs = model.state_spec.layers
    assert {s.conv_dtype for s in specs} == {torch.bfloat16}
    assert {s.temporal_dtype for s in specs} == {torch.float32}
    assert model.kv_spec.dtype == torch.bfloat16


def test_fp32_from_bf16_checkpoint_equals_transformers(moe_ckpt):
    from transformers import AutoModelForCausalLM

    folder = moe_ckpt / "bf16"
    sd = dict(read_safetensors(folder / "model.safetensors"))
    model = load_model(str(folder), dtype="float32")
    assert model.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, sd["model.embed_tokens.weight"].float())
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([TOKENS])).logits[0]
    assert torch.allclose(logits(model), ref, atol=1e-4)
    # control: the bf16-loaded model differs from that float32 reference
    assert not torch.allclose(
        logits(load_model(str(folder), dtype="bfloat16")).float(), ref, atol=1e-4
    )


def test_tied_embeddings_share_one_parameter(tmp_path):
    folder = tmp_path / "lfm2"
    make_tiny_checkpoint("lfm2", str(folder), seed=1, tie_word_embeddings=True)
    names = {n for n, _ in read_safetensors(folder / "model.safetensors")}
    assert "lm_head.weight" not in names
    model = load_model(str(folder))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_meta


# --------------------------------------------------------------------------- peak memory

_MEASURE = textwrap.dedent(
    """
    import sys, torch
    from mambaradix.models.loader import load_model, iter_weights
    from mambaradix.models.registry import import_model_modules
    from mambaradix.engine.pools import model_weight_bytes
    import transformers, safetensors.torch  # imported before the baseline
    import_model_modules()

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    base = status("VmRSS")
    folder, mode = sys.argv[1], sys.argv[2]
    if mode == "mmap":  # negative control: the memory-mapped safe_open way
        from safetensors import safe_open
        kept = []
        with safe_open(folder + "/model.safetensors", framework="pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                kept.append(torch.empty_like(t).copy_(t))
        weights = sum(t.numel() * t.element_size() for t in kept)
    else:
        model = load_model(folder, dtype=mode)
        weights = model_weight_bytes(model)
    print(status("VmHWM") - base, weights)
    """
)


def _peak(folder: Path, mode: str) -> tuple[int, int]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(folder), mode],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.split()
    return int(out[-2]), int(out[-1])


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> Path:
    """A ~300 MB bf16 Qwen3.5 checkpoint: names and shapes from transformers on the meta device,
    random values (fast, no initialisation)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    folder = tmp_path_factory.mktemp("big") / "qwen3_5"
    folder.mkdir()
    cfg = Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3_5ForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(sd, str(folder / "model.safetensors"))
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("mode", ["bfloat16", "float32"])
def test_peak_rss_while_loading_is_bounded(big_ckpt, mode):
    peak, weights = _peak(big_ckpt, mode)
    assert weights > 200 << 20
    assert peak <= 1.3 * weights, f"peak {peak / 2**20:.0f} MB for {weights / 2**20:.0f} MB"


def test_peak_rss_control_mmap_reading_exceeds_the_bound(big_ckpt):
    peak, weights = _peak(big_ckpt, "mmap")
    assert peak > 1.3 * weights  # the measurement can see a loader holding twice the weights


# --------------------------------------------------------------------------- start-up cost

_IMPORTS = textwrap.dedent(
    """
    import sys
    import torch
    from mambaradix.models.loader import load_model
    for folder in sys.argv[1:]:
        load_model(folder)
    print("torch._dynamo" in sys.modules)
    with torch.device("meta"):  # control: what the Mamba2 layer's A_log init once did on meta
        torch.log(torch.arange(1, 5, dtype=torch.float32))
    print("torch._dynamo" in sys.modules)
    """
)


def test_loading_does_not_import_torch_compile_machinery(tmp_path):
    """Building modules on the meta device must not reach torch's decompositions, whose first
    use imports torch._dynamo: ~1.5 s of every start (the Mamba2 layer's ``torch.arange``).
    Control, in the same process after the loads: the check sees the import when it happens."""
    folders = []
    for arch in ("granite_hybrid", "nemotron_h", "lfm2", "qwen3_next"):
        make_tiny_checkpoint(arch, str(tmp_path / arch), seed=1)
        folders.append(str(tmp_path / arch))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTS, *folders],
        check=True, capture_output=True, text=True, env=env,
    ).stdout.split()  # fmt: skip
    assert out[-2:] == ["False", "True"]  # after the loads; after the control
