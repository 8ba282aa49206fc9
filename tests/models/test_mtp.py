"""The MTP draft head (models/mtp.py) against a plain-torch reference of its formula.

The reference reads the checkpoint's tensors by their published names and computes, in
float64, over a whole sequence from position 0 with full causal attention (no pools):
``fc(concat(norm_e(embed(t)), norm_h(h)))`` -> gated attention layer (q/k norms, partial
rotate-half RoPE) -> the model's MLP (MoE with a gated shared expert, or dense) -> ``mtp.norm``
-> ``lm_head``. Our head runs over the pools with the backend's ops: a prefill after the
target's forward (same layout), single-token steps chained on its own outputs, a chunked
prefill and a batch.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from model_oracle import assert_close
from safetensors.torch import load_file

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import ForwardReq
from mambaradix.kernels.backend import create_backend
from mambaradix.layout import ForwardContext
from mambaradix.models.loader import load_model
from mambaradix.models.mtp import MtpHead
from mambaradix.models.tiny import make_tiny_checkpoint

ARCHS = ["qwen3_next", "qwen3_5"]  # MoE MLP / dense MLP
BACKENDS = ["torch", "cpu"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """``{arch: (folder with mtp.*, the same checkpoint without)}``, same seed."""
    root = tmp_path_factory.mktemp("mtp_ckpts")
    out = {}
    for arch in ARCHS:
        with_mtp, plain = root / f"{arch}-mtp", root / arch
        make_tiny_checkpoint(arch, str(with_mtp), seed=0, mtp=True)
        make_tiny_checkpoint(arch, str(plain), seed=0)
        out[arch] = (with_mtp, plain)
    return out


_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture
def mtp_model(ckpts):
    def get(arch: str, backend: str = "torch"):
        if arch not in _MODELS:
            _MODELS[arch] = load_model(str(ckpts[arch][0]), dtype=torch.float32, mtp=True)
        model = _MODELS[arch]
        model.use_backend(create_backend(backend))
        return model

    return get


def pools(model, size: int = 512):
    return KVPool(model.kv_spec, size), StatePool(model.state_spec, 8)


def new_req(kv, states, capacity: int = 64):
    slots = kv.alloc(capacity)
    (slot,) = states.alloc(1)
    states.clear([slot])
    return slots, slot


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# ---------------------------------------------------------------------- the reference


class Reference:
    """The MTP formula in plain float64 torch over a whole sequence (positions 0..n-1).

    ``swap``: concat (hidden, embedding) instead; ``skip``: names of norms left out. Both are
    for the negative controls only."""

    def __init__(self, folder, swap: bool = False, skip: tuple[str, ...] = ()) -> None:
        self.w = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
        cfg = json.loads((folder / "config.json").read_text())
        self.eps = cfg["rms_norm_eps"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        rope = cfg.get("rope_parameters") or {}
        self.theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        self.rotary_dim = int(self.head_dim * factor)
        self.top_k = cfg.get("num_experts_per_tok")
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.w.get("lm_head.weight", self.embed)
        self.swap, self.skip = swap, skip

    def norm(self, x, name: str):
        if name in self.skip:
            return x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1.0 + self.w[name])

    def rope(self, x, pos):
        rd = self.rotary_dim
        inv = 1.0 / self.theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
        freqs = pos.double()[:, None] * inv[None]
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        r, rest = x[..., :rd], x[..., rd:]
        half = torch.cat([-r[..., rd // 2 :], r[..., : rd // 2]], -1)
        return torch.cat([r * cos[:, None] + half * sin[:, None], rest], -1)

    def attention(self, x, pos):
        p, T, H, D = "mtp.layers.0.self_attn.", x.shape[0], self.heads, self.head_dim
        qg = (x @ self.w[p + "q_proj.weight"].T).view(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = (x @ self.w[p + "k_proj.weight"].T).view(T, self.kv_heads, D)
        v = (x @ self.w[p + "v_proj.weight"].T).view(T, self.kv_heads, D)
        q = self.rope(self.norm(q, p + "q_norm.weight"), pos)
        k = self.rope(self.norm(k, p + "k_norm.weight"), pos)
        k = k.repeat_interleave(H // self.kv_heads, dim=1)
        v = v.repeat_interleave(H // self.kv_heads, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) * D**-0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hts,shd->thd", probs, v) * torch.sigmoid(gate)
        return o.reshape(T, H * D) @ self.w[p + "o_proj.weight"].T

    def ffn(self, x, p: str):
        gate = x @ self.w[p + "gate_proj.weight"].T
        up = x @ self.w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "down_proj.weight"].T

    def mlp(self, x):
        p = "mtp.layers.0.mlp."
        if p + "gate.weight" not in self.w:
            return self.ffn(x, p)
        probs = (x @ self.w[p + "gate.weight"].T).softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for w, e in zip(weights[t], experts[t].tolist()):
                out[t] += w * self.ffn(x[t : t + 1], f"{p}experts.{e}.")[0]
        shared = self.ffn(x, p + "shared_expert.")
        return out + torch.sigmoid(x @ self.w[p + "shared_expert_gate.weight"].T) * shared

    def __call__(self, next_ids: list[int], hidden: torch.Tensor):
        """Rows at positions 0..n-1 -> (normed output [n, H], logits [n, V])."""
        pos = torch.arange(len(next_ids))
        e = self.norm(self.embed[torch.tensor(next_ids)], "mtp.pre_fc_norm_embedding.weight")
        h = self.norm(hidden.double(), "mtp.pre_fc_norm_hidden.weight")
        x = torch.cat([h, e] if self.swap else [e, h], -1) @ self.w["mtp.fc.weight"].T
        x = x + self.attention(self.norm(x, "mtp.layers.0.input_layernorm.weight"), pos)
        x = x + self.mlp(self.norm(x, "mtp.layers.0.post_attention_layernorm.weight"))
        out = self.norm(x, "mtp.norm.weight")
        return out, out @ self.lm_head.T


def target_prefill(model, kv, states, toks):
    """The target's prefill of ``toks``: (its context, logits of the last row, hidden [n, H])."""
    slots, slot = new_req(kv, states)
    ctx = ForwardContext.build([ForwardReq(0, toks, slots, slot)], kv, states)
    logits, hidden = model(ctx, return_hidden=True)
    return ctx, logits, hidden, slots, slot


def draft_chain(model, ref, toks, steps: int):
    """Target prefill, the head's prefill on the same context, then ``steps`` single-token
    steps chained on the head's own outputs; each compared with the reference over the whole
    sequence so far. Returns the rows fed to the reference (for the negative controls)."""
    kv, states = pools(model)
    ctx, logits, hidden, slots, slot = target_prefill(model, kv, states, toks)
    ids = toks[1:] + [int(logits[-1].argmax())]
    out, draft_logits = model.draft(ctx, hidden, torch.tensor(ids))
    ref_out, ref_logits = ref(ids, hidden)
    assert_close(out, ref_out, "draft prefill hidden (every row)", ATOL)
    assert_close(draft_logits, ref_logits[-1:], "draft prefill logits", ATOL)
    ref_hidden = [*hidden.double()]
    for step in range(steps):
        pos = len(toks) + step
        token = int(ref_logits[-1].argmax())  # the reference's token: no argmax tie can fork
        ref_hidden.append(ref_out[-1])
        ids.append(token)
        step_ctx = ForwardContext.build([ForwardReq(pos, [token], slots, slot)], kv, states)
        out, draft_logits = model.draft(step_ctx, out[-1:], torch.tensor([token]))
        ref_out, ref_logits = ref(ids, torch.stack(ref_hidden))
        assert_close(out, ref_out[-1:], f"chained step {step + 1} hidden", ATOL)
        assert_close(draft_logits, ref_logits[-1:], f"chained step {step + 1} logits", ATOL)
    return ids, torch.stack(ref_hidden), out, draft_logits


# ---------------------------------------------------------------------- checkpoint + loading


PUBLISHED_NAMES = [  # besides mtp.layers.0.mlp.* (the model's MLP kind)
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight",
    *(f"mtp.layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
    "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoint_has_the_published_mtp_layout(ckpts, arch):
    with_mtp, plain = ckpts[arch]
    w, base = (
        load_file(str(with_mtp / "model.safetensors")),
        load_file(str(plain / "model.safetensors")),
    )
    cfg = json.loads((with_mtp / "config.json").read_text())
    H, heads, kv_heads, D = (cfg[k] for k in ("hidden_size", "num_attention_heads",
                                                "num_key_value_heads", "head_dim"))  # fmt: skip
    mtp = {k for k in w if k.startswith("mtp.")}
    assert set(PUBLISHED_NAMES) <= mtp
    assert w["mtp.fc.weight"].shape == (H, 2 * H)
    assert w["mtp.layers.0.self_attn.q_proj.weight"].shape == (2 * heads * D, H)  # query + gate
    assert w["mtp.layers.0.self_attn.k_proj.weight"].shape == (kv_heads * D, H)
    mlp = {k.removeprefix("mtp.layers.0.mlp.") for k in mtp if ".mlp." in k}
    if arch == "qwen3_next":  # MoE: router, every expert, the gated shared expert
        assert {"gate.weight", "shared_expert_gate.weight"} <= mlp
        assert "experts.7.down_proj.weight" in mlp and "shared_expert.up_proj.weight" in mlp
    else:
        assert mlp == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["mtp_use_dedicated_embeddings"] is False
    # the model itself is the checkpoint without the head, tensor for tensor
    assert set(w) - mtp == set(base)
    assert all(torch.equal(w[k], base[k]) for k in base)


@pytest.mark.parametrize("arch", ARCHS)
def test_head_loads_with_its_own_kv_layer(ckpts, mtp_model, arch):
    model = mtp_model(arch)
    plain = load_model(str(ckpts[arch][0]), dtype=torch.float32)
    w = load_file(str(ckpts[arch][0] / "model.safetensors"))
    assert isinstance(model.mtp, MtpHead) and plain.mtp is None
    assert torch.equal(model.mtp.fc.weight, w["mtp.fc.weight"])
    assert torch.equal(model.mtp.norm.weight, w["mtp.norm.weight"])
    attn = model.mtp.layers[0].self_attn
    qkv = torch.cat([w[f"mtp.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(attn.qkv_proj.weight, qkv)
    # the KV spec gains one attention layer, the head's, after the model's
    assert model.kv_spec.num_layers == plain.kv_spec.num_layers + 1
    assert replace(model.kv_spec, num_layers=plain.kv_spec.num_layers) == plain.kv_spec
    assert attn.attn_layer == model.num_attn_layers == plain.kv_spec.num_layers
    # the state spec gains one layer, the head's (the last hidden state, [H] in the model's
    # dtype), after the model's recurrent layers
    assert model.state_spec.layers[:-1] == plain.state_spec.layers
    head = model.state_spec.layers[-1]
    assert head.conv_shape == (model.mtp.hidden_size,) and head.temporal_shape is None
    assert head.conv_dtype == model.dtype and model.mtp.state_layer == len(plain.state_spec.layers)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_default_model_unchanged(ckpts, mtp_model, arch, backend):
    """Target logits are bit-identical whether the checkpoint has the head, whether the head is
    loaded, and whether the hidden states are returned too."""
    with_mtp, plain = ckpts[arch]
    models = [load_model(str(plain), dtype=torch.float32),
              load_model(str(with_mtp), dtype=torch.float32), mtp_model(arch, backend)]  # fmt: skip
    toks = tokens(30, models[0].vocab_size, seed=1)
    outs = []
    for model in models:
        model.use_backend(create_backend(backend))
        kv, states = pools(model)
        slots, slot = new_req(kv, states)
        prefill = ForwardContext.build([ForwardReq(0, toks[:25], slots, slot)], kv, states)
        a = model(prefill, all_logits=True)
        decode = ForwardContext.build([ForwardReq(25, toks[25:26], slots, slot)], kv, states)
        b, hidden = model(decode, return_hidden=True)
        chunk = ForwardContext.build([ForwardReq(26, toks[26:], slots, slot)], kv, states)
        c = model(chunk)
        outs.append((a, b, c))
    assert models[1].kv_spec == models[0].kv_spec
    for other in outs[1:]:
        for x, y in zip(outs[0], other):
            assert torch.equal(x, y)


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_is_the_final_normed_state(ckpts, mtp_model, arch):
    """``return_hidden`` gives transformers' ``last_hidden_state`` (after the final norm), for
    every row; ``lm_head`` of its last row is the logits."""
    from transformers import AutoModelForCausalLM

    model = mtp_model(arch)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpts[arch][0]), dtype=torch.float32).eval()
    toks = tokens(20, model.vocab_size, seed=2)
    kv, states = pools(model)
    _, logits, hidden, _, _ = target_prefill(model, kv, states, toks)
    with torch.no_grad():
        ref = hf.model(input_ids=torch.tensor([toks])).last_hidden_state[0]
    assert_close(hidden, ref, "hidden vs transformers' last_hidden_state", 1e-4)
    with torch.inference_mode():
        assert torch.equal(model.project(hidden[-1:]), logits)


# ---------------------------------------------------------------------- draft vs the reference


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_prefill_then_chained_steps(ckpts, mtp_model, arch, backend):
    model = mtp_model(arch, backend)
    draft_chain(model, Reference(ckpts[arch][0]), tokens(12, model.vocab_size, seed=3), steps=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_chunked_prefill_and_batch(ckpts, mtp_model, arch, backend):
    """A head prefill in two chunks (the second reads the first's K/V from the pool) and two
    requests in one forward, each against the reference over its whole sequence."""
    model = mtp_model(arch, backend)
    ref = Reference(ckpts[arch][0])
    kv, states = pools(model)
    seqs = [tokens(n, model.vocab_size, seed=4 + n) for n in (11, 7)]
    # the target's hidden states of each whole sequence, and the head's inputs
    rows = []
    for toks in seqs:
        _, logits, hidden, _, _ = target_prefill(model, kv, states, toks)
        rows.append((toks[1:] + [int(logits[-1].argmax())], hidden))
    refs = [ref(ids, hidden) for ids, hidden in rows]

    # chunked: positions 0..5, then 6..10 with 6 cached
    (ids, hidden), (ref_out, ref_logits) = rows[0], refs[0]
    slots, slot = new_req(kv, states)
    for lo, hi in ((0, 6), (6, 11)):
        ctx = ForwardContext.build([ForwardReq(lo, seqs[0][lo:hi], slots, slot)], kv, states)
        out, logits = model.draft(ctx, hidden[lo:hi], torch.tensor(ids[lo:hi]), all_logits=True)
        assert_close(out, ref_out[lo:hi], f"chunk {lo}..{hi} hidden", ATOL)
        assert_close(logits, ref_logits[lo:hi], f"chunk {lo}..{hi} logits", ATOL)

    # batched: both sequences in one forward, logits at each one's last row
    reqs = []
    for toks in seqs:
        s, st = new_req(kv, states)
        reqs.append(ForwardReq(0, toks, s, st))
    ctx = ForwardContext.build(reqs, kv, states)
    out, logits = model.draft(
        ctx, torch.cat([h for _, h in rows]), torch.tensor([t for ids, _ in rows for t in ids])
    )
    assert_close(out, torch.cat([o for o, _ in refs]), "batched hidden", ATOL)
    assert_close(logits, torch.cat([lg[-1:] for _, lg in refs]), "batched logits", ATOL)


@pytest.mark.parametrize(
    "variant",
    [
        dict(swap=True),  # concat (hidden, embedding)
        dict(skip=("mtp.pre_fc_norm_hidden.weight",)),
        dict(skip=("mtp.pre_fc_norm_embedding.weight",)),
        dict(skip=("mtp.norm.weight",)),
    ],
    ids=["swapped-concat", "no-pre-fc-norm-hidden", "no-pre-fc-norm-embedding", "no-mtp-norm"],
)
def test_negative_controls_fail_the_comparison(ckpts, mtp_model, variant):
    """A reference with the concat swapped or a norm left out disagrees with the head, so the
    comparisons above can fail."""
    model = mtp_model("qwen3_next")
    with pytest.raises(AssertionError, match="max abs diff"):
        draft_chain(model, Reference(ckpts["qwen3_next"][0], **variant),
                    tokens(12, model.vocab_size, seed=3), steps=1)  # fmt: skip


def test_negative_control_pre_norm_hidden(ckpts, mtp_model):
    """Fed the target's hidden state before its final norm, the reference disagrees: the head
    reads the final-normed one."""
    model = mtp_model("qwen3_next")
    ref = Reference(ckpts["qwen3_next"][0])
    kv, states = pools(model)
    toks = tokens(12, model.vocab_size, seed=3)
    ctx, logits, hidden, _, _ = target_prefill(model, kv, states, toks)
    ids = toks[1:] + [int(logits[-1].argmax())]
    out, _ = model.draft(ctx, hidden, torch.tensor(ids))
    kv2, states2 = pools(model)
    ctx2 = ForwardContext.build([ForwardReq(0, toks, *new_req(kv2, states2))], kv2, states2)
    with torch.inference_mode():
        pre_norm = model.body(model.embedding(ctx2.layout.input_ids), ctx2)
    assert not torch.allclose(pre_norm, hidden, atol=1e-3)
    with pytest.raises(AssertionError, match="max abs diff"):
        assert_close(out, ref(ids, pre_norm)[0], "draft vs a pre-norm reference", ATOL)


# ---------------------------------------------------------------------- errors


def test_checkpoint_without_mtp_weights_raises(ckpts):
    with pytest.raises(ValueError, match=r"--speculative-algorithm NEXTN.*no mtp\.\* weights"):
        load_model(str(ckpts["qwen3_next"][1]), mtp=True)


def test_dedicated_mtp_embeddings_refused(ckpts, tmp_path):
    folder = tmp_path / "dedicated"
    shutil.copytree(ckpts["qwen3_5"][0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["mtp_use_dedicated_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings"):
        load_model(str(folder), mtp=True)


def test_draft_without_head_and_tiny_without_mtp_raise(ckpts, tmp_path):
    model = load_model(str(ckpts["qwen3_5"][0]), dtype=torch.float32)
    kv, states = pools(model)
    ctx = ForwardContext.build([ForwardReq(0, [1, 2], *new_req(kv, states))], kv, states)
    with pytest.raises(ValueError, match=r"mtp=True"):
        model.draft(ctx, torch.zeros(2, 64), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="has no MTP head"):
        make_tiny_checkpoint("lfm2", str(tmp_path / "lfm2"), mtp=True)
