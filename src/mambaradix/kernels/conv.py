"""Causal depthwise conv1d carrying a per-sequence state (torch reference kernels).

Layout: activations are token-major ``[T, C]`` (packed requests); a conv state is
``[C, K-1]``: the last ``K-1`` inputs of the sequence so far, oldest first (zeros at the start),
the same layout as Hugging Face's ``conv_states``. Weight is ``[C, K]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None or activation == "identity":
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv activation {activation!r} (use 'silu' or None)")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    seq_lens: list[int],
    activation: str | None = "silu",
) -> torch.Tensor:
    """Prefill over packed sequences: ``x`` is ``[T, C]`` with sequence ``i`` owning
    ``seq_lens[i]`` consecutive rows; ``conv_states`` ``[B, C, K-1]`` holds each sequence's
    carried-in state (not modified). Returns ``[T, C]``.

    One conv1d call for all sequences: each sequence's rows are preceded by its own state, so no
    window crosses into the previous sequence.
    """
    C, K = weight.shape
    pieces: list[torch.Tensor] = []
    start = 0
    for i, n in enumerate(seq_lens):
        pieces.append(conv_states[i].to(x.dtype))
        pieces.append(x[start : start + n].t())
        start += n
    xs = torch.cat(pieces, dim=1).unsqueeze(0)  # [1, C, T + B*(K-1)]
    y = F.conv1d(xs, weight.unsqueeze(1).to(x.dtype), bias, groups=C)[0]  # [C, L - K + 1]
    # Output column j covers input columns j .. j+K-1; token t of sequence i (input column
    # off_i + K-1 + t) therefore sits at output column off_i + t.
    if len(seq_lens) == 1:
        out = y
    else:
        idx, off = [], 0
        for n in seq_lens:
            idx.append(torch.arange(off, off + n))
            off += n + K - 1
        out = y.index_select(1, torch.cat(idx).to(y.device))
    return _activate(out.t(), activation)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for B sequences: ``x`` ``[B, C]``, ``conv_states`` ``[B, C, K-1]``.

    Returns ``(out [B, C], new_states [B, C, K-1])``; the input states are not modified.
    """
    window = torch.cat([conv_states.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    out = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        out = out + bias
    return _activate(out, activation), window[..., 1:]


def conv_state_after(x: torch.Tensor, conv_state: torch.Tensor, n: int) -> torch.Tensor:
    """The conv state after the first ``n`` rows of ``x`` (``[T, C]``) starting from
    ``conv_state`` (``[C, K-1]``): the last K-1 inputs, including carried-in ones when
    ``n < K-1``."""
    k1 = conv_state.shape[-1]
    if k1 == 0:
        return conv_state
    if n >= k1:
        return x[n - k1 : n].t()
    return torch.cat([conv_state[:, n:].to(x.dtype), x[:n].t()], dim=1)
