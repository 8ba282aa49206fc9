"""Published checkpoint configurations (the text model of each ``config.json``), written from
their published values, and random-weight checkpoints built from them with the dimensions a test
or benchmark can afford cut down.

``PUBLISHED[name]`` is a ``Published``: the transformers config class, the published fields and
where they were read (``published_configs.py`` holds the values). ``build_published(name,
folder, layers=..., vocab=..., experts=...)`` writes a seeded random checkpoint (bf16 by default,
as published) whose shapes are the published ones except what was cut: the layer count (the
published layer pattern, truncated so that every layer kind stays), the vocabulary, the number of
routed experts (top-k kept when it fits). Widths, head counts and head dims are never cut.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    """One published checkpoint: its transformers config and model classes and its fields."""

    config_class: str
    model_class: str
    fields: dict[str, Any]
    source: str

    def config(self, **cuts: int | None) -> Any:
        """The transformers config with ``cut_fields`` applied."""
        import transformers

        return getattr(transformers, self.config_class)(**cut_fields(self, **cuts))


def _layer_list_keys(fields: dict[str, Any]) -> list[str]:
    return [k for k in ("layer_types", "layers_block_type") if isinstance(fields.get(k), list)]


def _cut_pattern(kinds: list[str], layers: int) -> list[str]:
    """The first ``layers`` entries of a layer pattern, with the last entries replaced so that
    every kind of the full pattern appears (a cut must not drop the attention layers)."""
    head = list(kinds[:layers])
    missing = [k for k in dict.fromkeys(kinds) if k not in head]
    if len(missing) >= layers:
        raise ValueError(f"{layers} layers cannot hold every layer kind {sorted(set(kinds))}")
    for i, kind in enumerate(missing):
        head[layers - len(missing) + i] = kind
    return head


def cut_fields(
    pub: Published,
    layers: int | None = None,
    vocab: int | None = None,
    experts: int | None = None,
) -> dict[str, Any]:
    """The published fields with the layer count, vocabulary and routed-expert count cut."""
    f = dict(pub.fields)
    if layers is not None:
        keys = _layer_list_keys(f)
        for key in keys:
            f[key] = _cut_pattern(f[key], layers)
        if "num_hidden_layers" in f or not keys:
            f["num_hidden_layers"] = layers
        if isinstance(f.get("mlp_only_layers"), list):
            f["mlp_only_layers"] = [i for i in f["mlp_only_layers"] if i < layers]
        if f.get("num_dense_layers"):  # LFM2-MoE: keep a sparse layer in the cut
            f["num_dense_layers"] = min(f["num_dense_layers"], max(layers - 1, 0))
    if vocab is not None:
        f["vocab_size"] = vocab
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the cut wrap
            if isinstance(f.get(key), int) and f[key] >= vocab:
                f[key] = f[key] % vocab
    if experts is not None:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if f.get(key):
                f[key] = experts
        if isinstance(f.get("num_experts_per_tok"), int):
            f["num_experts_per_tok"] = min(f["num_experts_per_tok"], experts)
        if f.get("n_group"):  # group-limited routing: groups must divide the experts
            f["n_group"] = min(f["n_group"], experts)
            f["topk_group"] = min(f.get("topk_group", 1), f["n_group"])
    return f


def published_names() -> list[str]:
    from mambaradix.models.published_configs import PUBLISHED

    return sorted(PUBLISHED)


def get_published(name: str) -> Published:
    from mambaradix.models.published_configs import PUBLISHED

    if name not in PUBLISHED:
        raise KeyError(f"no published config {name!r}; known: {published_names()}")
    return PUBLISHED[name]


def build_published(
    name: str,
    folder: str | Path,
    *,
    layers: int | None = None,
    vocab: int | None = None,
    experts: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str = "cpu",
) -> Path:
    """Write a seeded random checkpoint of ``name`` (cut as asked) to ``folder`` in ``dtype``,
    with ``config.json`` naming that dtype; no tokenizer (callers that need one add it).
    ``device``: where the weights are drawn (a GPU draws a 9B model in seconds; the values
    differ from the CPU's for the same seed)."""
    import transformers

    pub = get_published(name)
    config = pub.config(layers=layers, vocab=vocab, experts=experts)
    model_cls = getattr(transformers, pub.model_class)
    # Built on the meta device and given memory in the target dtype, then initialised once by
    # transformers' own ``_init_weights`` (a plain construction runs every initialiser twice
    # in fp32: ~4x slower at hidden 4096). Non-persistent buffers (RoPE) are not saved.
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype).to_empty(device=device)
    torch.manual_seed(seed)
    model.apply(model._init_weights)
    model.tie_weights()
    model.eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    logger.info("wrote %s (layers %s, vocab %s, experts %s) to %s", name, layers, vocab, experts,
                folder)  # fmt: skip
    return folder
