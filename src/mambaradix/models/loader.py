"""Loading a model from a local Hugging Face checkpoint folder.

A folder holds ``config.json`` (read with ``transformers.AutoConfig``), weights as one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, and tokenizer files.
``resolve_model_path`` also accepts ``tiny:<arch>[:<size>]`` and builds (once, cached) a seeded
random checkpoint of that architecture.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mambaradix.models.registry import get_model_class

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file or holds something malformed."""


# --------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """Where built tiny checkpoints live: ``$MAMBARADIX_CACHE`` or ``~/.cache/mambaradix``."""
    env = os.environ.get("MAMBARADIX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mambaradix"


def resolve_model_path(spec: str) -> str:
    """``tiny:<arch>[:<size>]`` -> folder of a built (cached) tiny checkpoint; a plain path is
    checked to be a folder with a config.json and returned absolute."""
    if spec.startswith("tiny:"):
        from mambaradix.models.tiny import SIZES, make_tiny_checkpoint, tiny_archs

        parts = spec.split(":")
        arch = parts[1] if len(parts) > 1 else ""
        size = parts[2] if len(parts) > 2 else "tiny"
        if arch not in tiny_archs():
            raise CheckpointError(
                f"unknown tiny architecture {arch!r} in {spec!r}; available: {tiny_archs()}"
            )
        if size not in SIZES:
            raise CheckpointError(f"unknown tiny size {size!r} in {spec!r}; available: {SIZES}")
        folder = cache_root() / f"tiny-{arch}-{size}-seed0"
        if not (folder / "config.json").exists():
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".tiny-{arch}-", dir=folder.parent))
            make_tiny_checkpoint(arch, str(tmp), seed=0, size=size)
            try:
                tmp.rename(folder)  # atomic publish; another process may have won the race
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
            logger.info("built tiny checkpoint %s at %s", spec, folder)
        return str(folder)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"model path {spec!r} is not a folder; pass a local Hugging Face checkpoint folder "
            "(config.json + *.safetensors + tokenizer files) or 'tiny:<arch>'"
        )
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{spec!r} has no config.json; is it a Hugging Face checkpoint?")
    return str(path.resolve())


# --------------------------------------------------------------------------- config


def load_config(path: str) -> Any:
    """The HF config of a checkpoint folder, with clear errors."""
    folder = Path(resolve_model_path(path))
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder}/config.json is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise CheckpointError(
            f"{folder}/config.json has no 'model_type'; it must be a transformers config"
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds here
        raise CheckpointError(f"cannot read {folder}/config.json with transformers: {e}") from e


# --------------------------------------------------------------------------- weights


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed (needs a 'weight_map'): {e}") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards listed in {index.name} are missing: {missing}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(
        f"no weights in {folder}: expected model.safetensors or model.safetensors.index.json "
        "with its shards (convert .bin checkpoints with save_pretrained(safe_serialization=True))"
    )


def iter_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in weight_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def assign_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
) -> None:
    """Copy tensors into the model's parameters by name (already mapped to the model's names).

    Raises CheckpointError listing missing parameters, shape mismatches and (when strict)
    unexpected names.
    """
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unexpected, bad_shape = [], []
    with torch.no_grad():
        for name, tensor in weights:
            p = params.get(name)
            if p is None:
                unexpected.append(name)
                continue
            if tuple(p.shape) != tuple(tensor.shape):
                bad_shape.append(f"{name}: checkpoint {tuple(tensor.shape)} vs {tuple(p.shape)}")
                continue
            p.copy_(tensor.to(dtype=p.dtype, device=p.device))
            seen.add(name)
    missing = sorted(set(params) - seen)
    problems = []
    if missing:
        problems.append(f"missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if bad_shape:
        problems.append(f"shape mismatches: {bad_shape[:8]}")
    if strict and unexpected:
        problems.append(f"unexpected weights: {unexpected[:8]}")
    if problems:
        raise CheckpointError("checkpoint does not fit the model: " + "; ".join(problems))


def merge_weights(
    weights: Iterable[tuple[str, torch.Tensor]], merges: dict[str, tuple[str, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Concatenate (dim 0) the weights (and biases) of sibling linears into one fused module.

    ``merges`` maps a fused module name to its parts, e.g. ``{"gate_up_proj": ("gate_proj",
    "up_proj")}``: ``X.gate_proj.weight`` + ``X.up_proj.weight`` -> ``X.gate_up_proj.weight``.
    Names under ``.experts.<n>.`` are never merged. Incomplete groups pass through unchanged.
    """
    part_of = {part: (fused, parts) for fused, parts in merges.items() for part in parts}
    pending: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}

    def join(*names: str) -> str:
        return ".".join(n for n in names if n)

    for name, t in weights:
        prefix, _, leaf = name.rpartition(".")
        mod_prefix, _, mod = prefix.rpartition(".")
        hit = part_of.get(mod) if leaf in ("weight", "bias") else None
        if hit is None or (".experts." in name and mod_prefix.split(".")[-1].isdigit()):
            yield name, t
            continue
        fused, parts = hit
        key = (mod_prefix, fused, leaf)
        group = pending.setdefault(key, {})
        group[mod] = t
        if len(group) == len(parts):
            del pending[key]
            yield join(mod_prefix, fused, leaf), torch.cat([group[p] for p in parts], dim=0)
    for (mod_prefix, _, leaf), group in pending.items():
        for mod, t in group.items():
            yield join(mod_prefix, mod, leaf), t


# --------------------------------------------------------------------------- entry points


def _eos_ids(folder: Path, config: Any) -> list[int]:
    ids: list[int] = []

    def add(v: Any) -> None:
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, int) and x not in ids:
                ids.append(x)

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    add(getattr(text, "eos_token_id", None))
    add(getattr(config, "eos_token_id", None))
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            logger.warning("ignoring malformed %s", gen)
    return ids


def load_model(
    path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    ssm_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build the registered model for the checkpoint at ``path`` (or ``tiny:<arch>``) and load
    its weights. The model is in eval mode on ``device`` with parameters in ``dtype``."""
    folder = Path(resolve_model_path(path))
    config = load_config(str(folder))
    cls = get_model_class(getattr(config, "architectures", None))
    files = weight_files(folder)  # fail on missing weights before building the model
    model = cls(config, ssm_dtype=ssm_dtype)
    model.load_weights(iter_weights(folder))
    model.eos_token_ids = _eos_ids(folder, config) or list(getattr(model, "eos_token_ids", []))
    model.to(device=device, dtype=dtype)
    model.eval()
    logger.info("loaded %s from %s (%d weight files)", cls.__name__, folder, len(files))
    return model


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer`` of the checkpoint folder (or ``tiny:<arch>``), offline."""
    folder = resolve_model_path(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise CheckpointError(
            f"cannot load a tokenizer from {folder}: {e}; the folder needs tokenizer.json "
            "(or the tokenizer files of its class) and tokenizer_config.json"
        ) from e
