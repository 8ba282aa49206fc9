"""Our bf16 logits against transformers' bf16 logits of the same checkpoint (a Gated DeltaNet,
a Mamba2, an LFM2 short-conv hybrid and its MoE, Falcon-H1): a 96-token prefill (every
position) and 12 decode steps, each model with its own cache; the LFM2 case once more on the
cpu backend (native bf16 kernels) with its prefill's matmuls in fp32 (``kernels.bf16_matmul``:
the path a CPU whose bf16 matmul is the slower one takes).

Tolerance ``ATOL``: 0.15 nats, the largest difference of any log-softmax entry at a position,
except at the positions where transformers' bf16 itself is off from its fp32 by more than that
(a router near-tie flipped by rounding on the MoE model: seen at decode on an Intel Xeon with
AMX, 0.28 from transformers' bf16 there, 0.17 from fp32 where transformers' bf16 was 0.24).
Two bf16 implementations round at different places: the logits leave a bf16 LM head at
|logit| 1-4, where one bf16 step is 0.008-0.016, and the hidden state before it carries a few
steps of accumulated difference; measured: 0.02 (GDN + MoE), 0.04 (Mamba2), 0.08 (LFM2).
Besides, ours may be no further from the fp32 logits than transformers' bf16 is, plus ``ATOL``
(transformers' bf16 error, measured here: 0.05-0.12, and 0.7 on the MoE model, whose router
picks other experts at near-ties in bf16). Negative control: our model decoding from a zeroed
recurrent state (KV intact) after the prefill is off by more than 4 x ``ATOL`` (1.1-2 nats)."""

from __future__ import annotations

import pytest
import torch
from model_oracle import OracleCase, build_oracle

from mambaradix.kernels import bf16_matmul
from mambaradix.kernels.cpu_backend import CpuBackend

PREFILL, DECODE = 96, 12
ATOL = 0.15
CASES = [
    OracleCase("bf16_qwen3_next", "qwen3_next"),
    OracleCase("bf16_granite_hybrid", "granite_hybrid"),
    OracleCase("bf16_lfm2", "lfm2"),
    OracleCase("bf16_lfm2_moe", "lfm2_moe"),  # sigmoid routing: bf16 scores, fp32 bias
    OracleCase("bf16_falcon_h1", "falcon_h1"),  # muP multipliers folded into bf16 weights
    OracleCase("bf16_olmo_hybrid", "olmo_hybrid"),  # beta doubled, head dims 24 / 48
]


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1)


def ours(o, toks: list[int], zero_state: bool = False) -> torch.Tensor:
    kv, slot = o.new_request(len(toks))
    rows = [o.run(toks[:PREFILL], kv, slot)]
    if zero_state:
        o.states.clear([slot])
    for i in range(PREFILL, len(toks)):
        rows.append(o.run([toks[i]], kv, slot, prefix_len=i))
    return log_softmax(torch.cat(rows))


def theirs(o, hf, toks: list[int]) -> torch.Tensor:
    """transformers' prefill logits then its cached decode steps."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    rows = []
    with torch.no_grad():
        for start, step in [(0, toks[:PREFILL])] + [
            (i, [toks[i]]) for i in range(PREFILL, len(toks))
        ]:
            x = torch.tensor([step])
            pos = torch.arange(start, start + len(step))[None]
            rows.append(hf(input_ids=x, position_ids=pos, cache=cache, use_cache=True).logits[0])
    return log_softmax(torch.cat(rows))


# Each case with the many-row matmuls as this CPU runs them (kernels.bf16_matmul measures),
# and the LFM2 case again on the cpu backend with them forced through fp32 from every 32 rows
# (the prefill's 96).
RUNS = [(case, None) for case in CASES] + [(CASES[2], "fp32")]


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"{r[0]}-{r[1] or 'measured'}")
def logprobs(request, tmp_path_factory):
    """(ours bf16, transformers bf16, transformers fp32, ours bf16 from a zeroed state)."""
    case, mode = request.param
    if mode is None:
        return _logprobs(case, tmp_path_factory)
    saved = bf16_matmul._choice
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bf16_matmul, "MIN_ROWS", 32)
        calls, real = [], bf16_matmul.linear_fp32
        mp.setattr(bf16_matmul, "linear_fp32", lambda *a: calls.append(1) or real(*a))
        bf16_matmul.set_mode(mode)
        try:
            out = _logprobs(case, tmp_path_factory, CpuBackend())
        finally:
            bf16_matmul._choice = saved
    assert len(calls) > 10, "the prefill's matmuls did not take the fp32 path"
    return out


def _logprobs(case, tmp_path_factory, backend=None):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bf16_oracle")
    o = build_oracle(case, root, dtype=torch.bfloat16)
    if backend is not None:
        o.model.use_backend(backend)
    assert next(o.model.parameters()).dtype == torch.bfloat16
    hf32 = AutoModelForCausalLM.from_pretrained(str(root / case.name),
                                                dtype=torch.float32).eval()  # fmt: skip
    toks = o.tokens(PREFILL + DECODE, seed=3)
    got = ours(o, toks)
    o.reset()
    zeroed = ours(o, toks, zero_state=True)
    return got, theirs(o, o.hf, toks), theirs(o, hf32, toks), zeroed


def test_bf16_logits_match_transformers_bf16(logprobs):
    got, hf16, hf32, _ = logprobs
    rounding = (hf16 - hf32).abs().max().item()  # transformers' own bf16 error here
    vs_hf16 = (got - hf16).abs().max().item()
    vs_fp32 = (got - hf32).abs().max().item()
    print(f"\nbf16 rounding {rounding:.3f}, ours vs bf16 {vs_hf16:.3f}, vs fp32 {vs_fp32:.3f}")
    assert rounding > 0  # transformers really ran in bf16
    # Per position: within ATOL of transformers' bf16 logits, except where transformers' own
    # bf16 error jumps past ATOL (a discrete choice flipped by rounding: the MoE router at a
    # near-tie); there ours must be no further from fp32 than transformers is, plus ATOL.
    own = (hf16 - hf32).abs().amax(-1)
    flipped = own > ATOL
    far = (got - hf16).abs().amax(-1)[~flipped]
    assert (far <= ATOL).all(), f"ours vs transformers bf16: {far.max():.3f} > {ATOL}"
    assert flipped.float().mean() < 0.2, "transformers' bf16 is off at most positions"
    off32 = (got - hf32).abs().amax(-1) - own
    assert (off32 <= ATOL).all(), f"ours vs fp32 beyond transformers' error: {off32.max():.3f}"


def test_bf16_control_zeroed_state_is_caught(logprobs):
    _, hf16, _, zeroed = logprobs
    decode = slice(PREFILL, None)  # the prefill rows are computed before the state is zeroed
    off = (zeroed[decode] - hf16[decode]).abs().max().item()
    assert off > 4 * ATOL, f"a zeroed state moved the logprobs by only {off:.3f}"
