"""transformers as the logprob oracle of the server tests (its model: the ``hf_model``
fixture of conftest.py)."""

from __future__ import annotations

import torch


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """Row p: log-softmax of the oracle's logits after ``ids[: p + 1]`` ([len(ids), V])."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None])
    return torch.log_softmax(out.logits[0].float(), dim=-1)
