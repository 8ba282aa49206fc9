"""The per-row reductions the sampler needs on every step: the greedy token (argmax) and the
softmax's normalizer, in one native pass over fp32 logits (``csrc/sampling.c``), with torch as
the reference and the fallback.

The normalizer comes as ``(max, log_sum)``, ``log_sum = log(sum(exp(x - max)))``: a logprob is
then ``(x - max) - log_sum``, the way torch's ``log_softmax`` computes it."""

from __future__ import annotations

import torch

from mambaradix.kernels import native

Normalizer = tuple[torch.Tensor, torch.Tensor]  # max [B], log_sum [B]


def logprobs_of(values: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Logprobs of logits ``values`` ``[B, k]`` of the rows ``norm`` describes."""
    maxv, log_sum = norm
    return (values - maxv[:, None]) - log_sum[:, None]


def argmax_logsumexp_reference(
    logits: torch.Tensor, want_norm: bool = True
) -> tuple[torch.Tensor, Normalizer | None]:
    """``logits.argmax(-1)`` and the rows' ``(max, log_sum)`` of fp32 ``logits`` ``[B, V]``."""
    idx = logits.argmax(dim=-1)
    if not want_norm:
        return idx, None
    maxv = logits.amax(dim=-1)
    return idx, (maxv, (logits - maxv[:, None]).exp().sum(dim=-1).log())


def argmax_logsumexp(
    logits: torch.Tensor, want_norm: bool = True
) -> tuple[torch.Tensor, Normalizer | None]:
    """Per row of fp32 ``logits`` ``[B, V]`` (last dim dense): the index of its first maximum
    (int64 ``[B]``) and, if ``want_norm``, its ``(max, log_sum)`` (fp32 ``[B]`` each). Native
    on CPU; rows holding a NaN, and other inputs, get torch's answer."""
    lib = native.load("sampling")
    if (
        lib is None
        or logits.dtype is not torch.float32
        or logits.device.type != "cpu"
        or logits.dim() != 2
        or logits.stride(1) != 1
        or logits.shape[1] == 0
    ):
        return argmax_logsumexp_reference(logits, want_norm)
    B, V = logits.shape
    idx = torch.empty(B, dtype=torch.int64)
    norm = (torch.empty(B), torch.empty(B)) if want_norm else None
    lib.argmax_logsumexp(
        B, V, logits.data_ptr(), logits.stride(0), idx.data_ptr(),
        None if norm is None else norm[0].data_ptr(),
        None if norm is None else norm[1].data_ptr(), int(want_norm),
    )  # fmt: skip
    nan_rows = (idx < 0).nonzero()[:, 0]
    if nan_rows.numel():  # torch's rule for NaN (it counts as the maximum)
        ref_idx, ref_norm = argmax_logsumexp_reference(logits[nan_rows], want_norm)
        idx[nan_rows] = ref_idx
        if norm is not None and ref_norm is not None:
            norm[0][nan_rows], norm[1][nan_rows] = ref_norm
    return idx, norm
