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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mambaradix.models.registry import get_model_class
from mambaradix.models.weights import (  # noqa: F401  (re-exported for the model modules)
    CheckpointError,
    FileTensor,
    Lazy,
    assign_weights,
    dequantized_fp8,
    merge_weights,
    meta_tensors,
    no_init,
    read_safetensors,
    scan_safetensors,
)

logger = logging.getLogger(__name__)


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


def iter_weights(folder: Path) -> Iterator[tuple[str, Lazy]]:
    """Every checkpoint tensor of the folder, in its checkpoint dtype, not read yet (each is read
    into the parameter it fills); a block-FP8 checkpoint's weights dequantized as they are read
    (``fp8_checkpoint``)."""
    tensors = (t for f in weight_files(folder) for t in scan_safetensors(f))
    if fp8_checkpoint(folder):
        yield from dequantized_fp8(tensors, str(folder))
    else:
        yield from tensors


def fp8_checkpoint(folder: Path) -> bool:
    """Whether config.json's ``quantization_config`` is the published block-FP8 format
    (``quant_method: fp8``, ``weight_block_size [128, 128]``: e4m3 weights with fp32
    ``weight_scale_inv`` per block). Another quantization is a CheckpointError naming it."""
    raw = json.loads((folder / "config.json").read_text()) if folder.is_dir() else {}
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get(
        "quantization_config"
    )
    if not quant:
        return False
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method == "fp8" and list(block or []) == [128, 128]:
        return True
    raise CheckpointError(
        f"{folder}: quantization_config {method!r} (weight_block_size {block}) is not "
        "supported; block-FP8 checkpoints (quant_method fp8, weight_block_size [128, 128]) "
        "and unquantized ones load (--quantization fp8 quantizes the latter)"
    )


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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(path: str) -> torch.dtype:
    """The dtype the checkpoint's weights were saved in, from its config.json: ``dtype``
    (transformers >= 5), ``torch_dtype`` (older), or the same in ``text_config``; float32 when
    none is given. Dtypes the engine does not run (float64, fp8 ...) fall back to float32."""
    folder = Path(resolve_model_path(path))
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{folder}/config.json is not valid JSON: {e}") from e
    for cfg in (raw, raw.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            name = cfg.get(key)
            if isinstance(name, str):
                name = name.removeprefix("torch.")
                if name in DTYPES:
                    return DTYPES[name]
                logger.warning("checkpoint dtype %r is not run here; using float32", name)
                return torch.float32
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype, path: str) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype; a name or a torch dtype -> that dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return checkpoint_dtype(path)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


QUANTIZATIONS = ("fp8",)


def mark_quantized(model: nn.Module, method: str) -> int:
    """Mark the weights that load quantized (a module's ``quantized_leaves``): every
    ``layers.ops.Linear``'s but the LM head's (``lm_head``, tied or not: the logits keep the
    checkpoint's precision, as the published FP8 checkpoints keep it) and those marked not
    ``quantizable`` (routers), and the routed experts' stacks (a module's ``expert_stacks()``).
    Returns how many weights (a stack counts once) were marked."""
    from mambaradix.layers.ops import Linear

    if method not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {method!r}; choose one of {QUANTIZATIONS}")
    count = 0
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.quantizable and name.rsplit(".", 1)[-1] != "lm_head":
            mod.quantized_leaves = ("weight",)
        elif hasattr(mod, "expert_stacks"):
            mod.quantized_leaves = mod.expert_stacks()
        count += len(getattr(mod, "quantized_leaves", ()))
    return count


def load_model(
    path: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    ssm_dtype: torch.dtype = torch.float32,
    mtp: bool = False,
    fast_bf16: bool | None = None,
    quantization: str = "",
) -> nn.Module:
    """Build the registered model for the checkpoint at ``path`` (or ``tiny:<arch>``) and load
    its weights. The model is in eval mode on ``device`` with parameters in ``dtype`` (``auto``:
    the checkpoint's; modules that keep some parameters in float32 keep them).

    ``fast_bf16``: whether the kernels the model will run on compute bf16 about as fast as fp32
    on this CPU (``KernelBackend.fast_bf16_on_cpu``); where they do not, ``auto`` computes a
    bf16 checkpoint in float32 on a CPU. None: where torch's bf16 matmul runs in hardware.

    ``mtp``: also build and load the checkpoint's multi-token-prediction draft head
    (``models/mtp.py``: ``model.mtp``, ``model.draft``; its attention layers extend
    ``model.kv_spec``). A ValueError names the fix where the architecture has no MTP head here
    or the checkpoint has no ``mtp.*`` weights.

    ``quantization`` ``"fp8"``: the linears ``mark_quantized`` picks store their weights as
    ``kernels.fp8.Fp8Weight``, each quantized as it is read (the dense copy never exists whole);
    ``"none"``: dense; ``""``: the checkpoint's own (``fp8`` for a block-FP8 checkpoint, whose
    weights are dequantized as they are read and quantized again to power-of-two block scales:
    ``kernels.fp8.quantize``).

    The model is built without initialisation (``weights.no_init``: meta parameters) and each
    parameter is materialised from the checkpoint tensor that fills it, one at a time; what is
    still on the meta device afterwards (a tensor a module forgot to compute on a real device)
    is an error, not a silent garbage value."""
    folder = Path(resolve_model_path(path))
    config = load_config(str(folder))
    cls = get_model_class(getattr(config, "architectures", None))
    files = weight_files(folder)  # fail on missing weights before building the model
    kwargs: dict[str, Any] = {}
    if mtp:
        from mambaradix.models.mtp import check_mtp_supported

        if not getattr(cls, "supports_mtp", False):
            raise ValueError(
                f"{cls.__name__} has no multi-token-prediction head here (MTP runs with "
                "Qwen3-Next / Qwen3.5 checkpoints); run without --speculative-algorithm"
            )
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        check_mtp_supported(text, (name for name, _ in iter_weights(folder)), str(folder))
        kwargs["mtp"] = True
    target = resolve_dtype(dtype, str(folder))
    if dtype == "auto" and target == torch.bfloat16 and str(device).startswith("cpu"):
        if fast_bf16 is None:
            from mambaradix.kernels.cpu_features import fast_bf16_matmul

            fast_bf16 = fast_bf16_matmul()
        if not fast_bf16:
            logger.warning(
                "the checkpoint is bf16 but neither this CPU (no AVX512-BF16 / AMX) nor the "
                "kernel backend computes bf16 fast here: computing in float32, with twice the "
                "weight memory; --dtype bfloat16 forces bf16"
            )
            target = torch.float32
    with no_init():
        model = cls(config, ssm_dtype=ssm_dtype, **kwargs)
    model.to(dtype=target)  # meta parameters take their target dtypes (overrides included)
    if quantization == "":  # the checkpoint's own
        quantization = "fp8" if fp8_checkpoint(folder) else "none"
    if quantization != "none":
        count = mark_quantized(model, quantization)
        logger.info("%s: %d linears' weights quantized to %s as they load", cls.__name__,
                    count, quantization)  # fmt: skip
    model.load_weights(iter_weights(folder))  # materialised on the CPU, moved below
    left = meta_tensors(model)
    if left:
        raise RuntimeError(f"{cls.__name__}: tensors left unmaterialised after loading: {left}")
    model.eos_token_ids = _eos_ids(folder, config) or list(getattr(model, "eos_token_ids", []))
    model.to(device=device)
    model.eval()
    logger.info("loaded %s from %s (%d weight files, %s)", cls.__name__, folder, len(files), target)
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
