"""Weights from safetensors into a model built without initialisation.

``load_model`` builds the model inside ``no_init()``: every parameter is a meta tensor (no
memory, no initialiser runs), then ``assign_weights`` materialises each parameter from the
checkpoint tensor that fills it, one tensor at a time:

    file --read--> tensor (checkpoint dtype) --[merge / stack / regroup]--> parameter

A tensor whose dtype and layout already are the parameter's becomes the parameter (no copy);
otherwise it is converted into a fresh parameter and dropped. Tensors are read with plain
``readinto`` rather than through a memory map: a mapped file's pages count in the process's
resident set for as long as the map lives (measured: peak RSS ~2x the weight bytes with
``safe_open`` against ~1x read this way), and the page cache keeps the file warm either way.
"""

from __future__ import annotations

import contextlib
import json
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file or holds something malformed."""


# --------------------------------------------------------------------------- no initialisation

_PATCH_LOCK = threading.Lock()


def _torch_init_methods() -> list[tuple[type, str]]:
    """``(class, method)`` for every torch module class (private bases such as ``_ConvNd``
    included) defining its own initialiser."""
    out, todo, seen = [], [nn.Module], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("torch."):
            for meth in ("reset_parameters", "_reset_parameters"):
                if meth in cls.__dict__:
                    out.append((cls, meth))
    return out


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Build modules with meta parameters and no initialiser: factory calls default to the meta
    device and torch.nn modules' ``reset_parameters`` are no-ops while inside. Tensors a module
    must compute itself (rotary frequencies) are created with an explicit device.

    The initialisers are patched on the classes, process-wide, for the duration (a lock keeps
    two loads from interleaving); no other thread should build torch.nn modules meanwhile."""
    with _PATCH_LOCK:
        saved = [(cls, meth, cls.__dict__[meth]) for cls, meth in _torch_init_methods()]
        try:
            for cls, meth, _ in saved:
                setattr(cls, meth, lambda self, *a, **k: None)
            with torch.device("meta"):
                yield
        finally:
            for cls, meth, fn in saved:
                setattr(cls, meth, fn)


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of parameters, buffers and tensor attributes still on the meta device."""
    out = []
    for mod_name, mod in model.named_modules():
        for name, t in [*mod._parameters.items(), *mod._buffers.items(), *vars(mod).items()]:
            if isinstance(t, torch.Tensor) and t.is_meta:
                out.append(f"{mod_name}.{name}" if mod_name else name)
    return sorted(set(out))


# --------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _header(fh, path: Path) -> tuple[dict, int]:
    raw = fh.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"{path} is not a safetensors file (shorter than its header)")
    (n,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(fh.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} has a malformed safetensors header: {e}") from e
    header.pop("__metadata__", None)
    return header, 8 + n


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file, in file order, each in a fresh buffer of its own
    (read straight into it; nothing else of the file is held)."""
    with open(path, "rb", buffering=0) as fh:
        header, base = _header(fh, path)
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        for name, info in entries:
            dtype = _ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(
                    f"{path.name}: tensor {name} has dtype {info['dtype']}, which the loader "
                    f"does not read (supported: {sorted(_ST_DTYPES)})"
                )
            begin, end = info["data_offsets"]
            buf = torch.empty(end - begin, dtype=torch.uint8)
            view = memoryview(buf.numpy()) if end > begin else memoryview(b"")
            fh.seek(base + begin)
            done = 0
            while done < end - begin:
                got = fh.readinto(view[done:])
                if not got:
                    raise CheckpointError(f"{path.name} is truncated (tensor {name})")
                done += got
            yield name, buf.view(dtype).view(info["shape"])


# --------------------------------------------------------------------------- assignment


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) holding each parameter (a tied parameter has several)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for leaf, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, leaf))
    return owners


def _owns_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0


def _materialise(p: nn.Parameter, t: torch.Tensor, device: torch.device) -> nn.Parameter:
    """A real parameter with ``p``'s dtype, shape and strides holding ``t``'s values."""
    t = t.to(device=device) if t.device != device else t
    if t.dtype == p.dtype and t.stride() == p.stride() and _owns_storage(t):
        data = t  # read in the right dtype and layout: the buffer becomes the parameter
    else:
        data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
        data.copy_(t)
    return nn.Parameter(data, requires_grad=p.requires_grad)


def assign_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    strict: bool = True,
    device: str | torch.device | None = None,
) -> None:
    """Fill the model's parameters by name (names already mapped to the model's).

    A meta parameter (model built under ``no_init``) is replaced by a real one with its dtype
    and layout, on ``device`` (default cpu), in every module that holds it (tied weights); a
    real parameter is copied into. Raises CheckpointError listing missing parameters, shape
    mismatches and (when strict) unexpected names."""
    dev = torch.device(device or "cpu")
    params = dict(model.named_parameters())
    owners = _owners(model)
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
            if p.is_meta:
                new = _materialise(p, tensor, dev)
                for mod, leaf in owners.pop(id(p)):
                    mod._parameters[leaf] = new
                owners[id(new)] = []
                params[name] = new
            else:
                p.copy_(tensor.to(dtype=p.dtype, device=p.device))
            seen.add(name)
            del tensor
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
    Names under ``.experts.<n>.`` are never merged. A group is held only until its last part
    arrives (then its parts are dropped); incomplete groups pass through unchanged at the end.
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
        del t
        if len(group) == len(parts):
            del pending[key]
            merged = torch.cat([group.pop(p) for p in parts], dim=0)
            yield join(mod_prefix, fused, leaf), merged
    for (mod_prefix, _, leaf), group in pending.items():
        for mod, t in group.items():
            yield join(mod_prefix, mod, leaf), t
