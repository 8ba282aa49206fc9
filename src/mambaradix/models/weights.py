"""Weights from safetensors into a model built without initialisation.

``load_model`` builds the model inside ``no_init()``: every parameter is a meta tensor (no
memory, no initialiser runs), then ``assign_weights`` materialises each parameter from the
checkpoint tensor that fills it, one tensor at a time:

    file --scan--> FileTensor (where it lies) --[merge / stack / regroup: lazy]--> parameter
                                                                  |
          the parameter is allocated once, in its dtype and layout, and read into: --+

The pipeline carries ``Lazy`` tensors (a place in the file, or a concatenation / stack / row
permutation of such places), so a fused projection's parts are read straight into their rows of
the fused parameter: each weight byte is written once. Fresh memory is what loading costs here
(the first write of a page costs more than the copy; a 1.4 GB checkpoint read, concatenated and
copied spent ~1.7 s of 3.5 s in ``torch.cat`` alone). A part whose dtype or layout differs from
the parameter's is read into a buffer of its own and converted. Tensors are read with plain
``readinto`` rather than through a memory map: a mapped file's pages count in the process's
resident set for as long as the map lives (measured: peak RSS ~2x the weight bytes with
``safe_open`` against ~1x read this way), and the page cache keeps the file warm either way.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from mambaradix.host_memory import WeightArena
from mambaradix.kernels.fp8 import Fp8Weight, dequantize


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


class Lazy:
    """A tensor not read yet: its ``shape`` and ``dtype``, and ``read_into(out)``, which writes
    its values into ``out`` (same shape, any dtype and strides: the parameter being built)."""

    shape: torch.Size
    dtype: torch.dtype

    def read_into(self, out: torch.Tensor) -> None:
        raise NotImplementedError

    def tensor(self) -> torch.Tensor:
        """The values in a fresh contiguous tensor of this dtype."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


def write_into(src: torch.Tensor | Lazy, out: torch.Tensor) -> None:
    if isinstance(src, Lazy):
        src.read_into(out)
    else:
        out.copy_(src)


def materialised(t: torch.Tensor | Lazy) -> torch.Tensor:
    return t.tensor() if isinstance(t, Lazy) else t


class FileTensor(Lazy):
    """One tensor of a safetensors file: read straight into ``out`` when ``out`` is contiguous
    and of the file's dtype, else into a buffer of its own and converted."""

    def __init__(self, path: Path, name: str, offset: int, nbytes: int, dtype, shape) -> None:
        self.path, self.name, self.offset, self.nbytes = path, name, offset, nbytes
        self.dtype, self.shape = dtype, torch.Size(shape)

    def read_into(self, out: torch.Tensor) -> None:
        if tuple(out.shape) != tuple(self.shape):
            raise CheckpointError(f"{self.name}: {tuple(self.shape)} read into {tuple(out.shape)}")
        if out.dtype != self.dtype or not out.is_contiguous():
            out.copy_(self.tensor())
            return
        if self.nbytes == 0:
            return
        # Fault the pages in first, in parallel threads: the kernel faulting them one by one
        # inside the read took 3-4x as long here (1.5 GB: 3.5-4.1 s against 1.0)
        out.zero_()
        view = memoryview(out.view(-1).view(torch.uint8).numpy())
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(self.offset)
            done = 0
            while done < self.nbytes:
                got = fh.readinto(view[done:])
                if not got:
                    raise CheckpointError(f"{self.path.name} is truncated (tensor {self.name})")
                done += got


class Concat(Lazy):
    """Tensors joined along ``dim`` (a fused projection: its output rows, dim 0, or its input
    columns, dim 1): each part read into its slice."""

    def __init__(self, parts: list[torch.Tensor | Lazy], dim: int = 0) -> None:
        rests = {tuple(d for i, d in enumerate(p.shape) if i != dim) for p in parts}
        if len(rests) != 1:
            raise CheckpointError(f"cannot fuse parts of shapes {[tuple(p.shape) for p in parts]}")
        self.parts, self.dim = parts, dim
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape = torch.Size(shape)
        self.dtype = parts[0].dtype
        for p in parts[1:]:
            self.dtype = torch.promote_types(self.dtype, p.dtype)

    def read_into(self, out: torch.Tensor) -> None:
        at = 0
        for p in self.parts:
            write_into(p, out.narrow(self.dim, at, p.shape[self.dim]))
            at += p.shape[self.dim]


class Mapped(Lazy):
    """``fn`` of a tensor, ``fn`` keeping its shape and dtype (a row permutation)."""

    def __init__(self, src: torch.Tensor | Lazy, fn) -> None:
        self.src, self.fn, self.shape, self.dtype = src, fn, src.shape, src.dtype

    def read_into(self, out: torch.Tensor) -> None:
        out.copy_(self.fn(materialised(self.src)))


class Dequantized(Lazy):
    """A published FP8 checkpoint's weight: e4m3 codes times their block scales
    (``weight_scale_inv``, one per 128 x 128 block), computed in fp32 (exact) and rounded once
    to the parameter's dtype, as transformers dequantizes them."""

    def __init__(self, codes: torch.Tensor | Lazy, scale: torch.Tensor | Lazy) -> None:
        self.codes, self.scale = codes, scale
        self.shape, self.dtype = codes.shape, torch.float32

    def read_into(self, out: torch.Tensor) -> None:
        out.copy_(dequantize(materialised(self.codes), materialised(self.scale), torch.float32))


def dequantized_fp8(
    weights: Iterable[tuple[str, torch.Tensor | Lazy]], where: str
) -> Iterator[tuple[str, torch.Tensor | Lazy]]:
    """A block-FP8 checkpoint's tensors with each ``<m>.weight`` (e4m3) and its
    ``<m>.weight_scale_inv`` joined into one ``Dequantized`` weight; the rest as they are. A
    code tensor without its scales, or scales of the wrong grid, is a CheckpointError."""
    tensors = dict(weights)  # (lazy: only the headers were read)
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            if name.removesuffix("_scale_inv") not in tensors:
                raise CheckpointError(f"{where}: {name} scales no tensor")
            continue
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            yield name, t
            continue
        scale = tensors.get(name + "_scale_inv")
        if t.dtype != torch.float8_e4m3fn or scale is None or len(t.shape) != 2:
            raise CheckpointError(f"{where}: {name} ({t.dtype}) needs e4m3 codes in 2 dims "
                                  f"and {name}_scale_inv beside them")  # fmt: skip
        grid = Fp8Weight.spans(tuple(t.shape))[1][0]
        if tuple(scale.shape) != grid:
            raise CheckpointError(f"{where}: {name}_scale_inv is {tuple(scale.shape)}, the "
                                  f"128 x 128 blocks of {tuple(t.shape)} need {grid}")  # fmt: skip
        yield name, Dequantized(t, scale)


def scan_safetensors(path: Path) -> Iterator[tuple[str, FileTensor]]:
    """Each tensor of a safetensors file, in file order, as a ``FileTensor`` (nothing read)."""
    with open(path, "rb", buffering=0) as fh:
        header, base = _header(fh, path)
    size = path.stat().st_size
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    for name, info in entries:
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(
                f"{path.name}: tensor {name} has dtype {info['dtype']}, which the loader "
                f"does not read (supported: {sorted(_ST_DTYPES)})"
            )
        begin, end = info["data_offsets"]
        if base + end > size:
            raise CheckpointError(f"{path.name} is truncated (tensor {name})")
        yield name, FileTensor(path, name, base + begin, end - begin, dtype, info["shape"])


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a safetensors file, in file order, each in a fresh buffer of its own."""
    for name, t in scan_safetensors(path):
        yield name, t.tensor()


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


GATED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PLAIN_EXPERTS = {"up_proj": ("up_proj",), "down_proj": ("down_proj",)}
# LFM2-MoE's checkpoints: per expert ``w1`` (gate), ``w3`` (up), ``w2`` (down)
W123_EXPERTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}


def stack_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor | Lazy]],
    num_experts: Callable[[str], int] | None = None,
    fused: dict[str, tuple[str, ...]] = GATED_EXPERTS,
) -> Iterator[tuple[str, torch.Tensor | Lazy]]:
    """Pass weights through, replacing per-expert tensors by fused stacks, ``fused`` naming
    each stack's parts: gated experts' ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
    ``down_proj`` ``[E, H, I]``, or plain experts' ``up_proj`` / ``down_proj``
    (``PLAIN_EXPERTS``). Lazily: a ``Stack``, each expert read into its place in the
    parameter, whatever layout ``expert_weights`` gave it.

    ``num_experts(prefix)`` (the block's ``...experts`` module name -> E) lets a stack be
    emitted as soon as its last expert arrived, holding at most one block's experts; without it
    every block is held until the end of the checkpoint."""
    groups: dict[str, dict[str, dict[int, torch.Tensor | Lazy]]] = {}
    stack_of = {part: stack for stack, parts in fused.items() for part in parts}

    for name, t in weights:
        m = _PER_EXPERT.match(name)
        if m is None or m.group(3) not in stack_of:
            yield name, t
            continue
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        groups.setdefault(prefix, {}).setdefault(kind, {})[e] = t
        del t
        if num_experts is None:
            continue
        n = num_experts(prefix)
        stack = stack_of[kind]
        if all(len(groups[prefix].get(k, {})) == n for k in fused[stack]):
            yield f"{prefix}.{stack}", _stack(prefix, groups[prefix], n, *fused[stack])
        if not groups[prefix]:
            del groups[prefix]
    for prefix, kinds in list(groups.items()):
        n = 1 + max(max(d) for d in kinds.values())
        for stack, parts in fused.items():
            if any(k in kinds for k in parts):
                yield f"{prefix}.{stack}", _stack(prefix, kinds, n, *parts)


def _stack(prefix: str, kinds: dict[str, dict[int, torch.Tensor | Lazy]], n: int, *parts: str):
    """Pop the experts of ``parts``: a ``Stack`` of, per expert, its parts joined along dim 0."""
    per = []
    for kind in parts:
        d = kinds.pop(kind, {})
        if len(d) != n:
            raise CheckpointError(f"{prefix}: expected {n} {kind} experts, found {len(d)}")
        per.append(d)
    return Stack([Concat([d[e] for d in per]) if len(per) > 1 else per[0][e] for e in range(n)])


class Stack(Lazy):
    """Tensors of one shape stacked along a new dim 0 (the experts of a block)."""

    def __init__(self, items: list[torch.Tensor | Lazy]) -> None:
        if len({tuple(t.shape) for t in items}) != 1:
            shapes = [tuple(t.shape) for t in items]
            raise CheckpointError(f"cannot stack tensors of shapes {shapes}")
        self.items = items
        self.shape = torch.Size((len(items), *items[0].shape))
        self.dtype = items[0].dtype
        for t in items[1:]:
            self.dtype = torch.promote_types(self.dtype, t.dtype)

    def read_into(self, out: torch.Tensor) -> None:
        for e, t in enumerate(self.items):
            write_into(t, out[e])


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


def _materialise(
    p: nn.Parameter, t: torch.Tensor | Lazy, device: torch.device, arena: WeightArena | None
) -> nn.Parameter:
    """A real parameter with ``p``'s dtype, shape and strides holding ``t``'s values, cut from
    ``arena`` where it has one."""
    if arena is not None and _in_arena(p):
        data = arena.take(p.shape, p.dtype)
        write_into(t, data)
        return nn.Parameter(data, requires_grad=p.requires_grad)
    if isinstance(t, Lazy):
        data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype)
        t.read_into(data)  # read in place: the one write of these bytes
        data = data.to(device=device) if data.device != device else data
        return nn.Parameter(data, requires_grad=p.requires_grad)
    t = t.to(device=device) if t.device != device else t
    if t.dtype == p.dtype and t.stride() == p.stride() and _owns_storage(t):
        data = t  # read in the right dtype and layout: the buffer becomes the parameter
    else:
        data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
        data.copy_(t)
    return nn.Parameter(data, requires_grad=p.requires_grad)


def _in_arena(p: nn.Parameter) -> bool:
    return p.is_meta and p.numel() > 0 and p.is_contiguous()


def _weight_arena(params: Iterable[nn.Parameter], device: torch.device) -> WeightArena | None:
    """One arena (``host_memory.WeightArena``: huge pages) for every meta parameter on the CPU
    (tiny models too: every test's model is loaded the way a real one is)."""
    if device.type != "cpu":
        return None
    nbytes = sum(WeightArena.span(p.shape, p.dtype) for p in params if _in_arena(p))
    return WeightArena(nbytes) if nbytes else None


def _quantized_weights(
    params: dict[str, nn.Parameter], owners: dict
) -> dict[int, tuple[nn.Module, str]]:
    """The meta weights stored as fp8 (a module's ``quantized_leaves``: ``loader.mark_quantized``),
    by id, with their module and name: those one module alone holds (a weight tied to another
    stays dense)."""
    found = {}
    for p in params.values():
        held = owners.get(id(p), [])
        if p.is_meta and p.dim() in (2, 3) and len(held) == 1:
            mod, leaf = held[0]
            if leaf in getattr(mod, "quantized_leaves", ()):
                found[id(p)] = (mod, leaf)
    return found


def _fp8_arena(weights: Iterable[nn.Parameter], device: torch.device) -> WeightArena | None:
    """The arena the fp8 codes and scales of ``weights`` are cut from (huge pages, as dense
    weights are)."""
    spans = [s for p in weights for s in Fp8Weight.spans(p.shape)]
    if device.type != "cpu" or not spans:
        return None
    return WeightArena(sum(WeightArena.span(shape, dtype) for shape, dtype in spans))


def _quantize_into(
    p: nn.Parameter, t: torch.Tensor | Lazy, arena: WeightArena | None, device: torch.device
) -> Fp8Weight:
    """``t`` read in fp32 (one weight at a time: the copy is freed at once; a dequantized FP8
    checkpoint's values unrounded) and quantized, into ``arena`` where there is one."""
    dense = torch.empty(p.shape, dtype=torch.float32)
    write_into(t, dense)
    out = None if arena is None else tuple(arena.take(s, d) for s, d in Fp8Weight.spans(p.shape))
    return Fp8Weight.from_dense(dense, out).to(device)


def assign_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | Lazy]],
    strict: bool = True,
    device: str | torch.device | None = None,
) -> None:
    """Fill the model's parameters by name (names already mapped to the model's).

    A meta parameter (model built under ``no_init``) is replaced by a real one with its dtype
    and layout, on ``device`` (default cpu), in every module that holds it (tied weights); a
    real parameter is copied into. On the CPU the new parameters are cut from one
    ``WeightArena`` (huge pages: the weights stream faster in decode). Raises CheckpointError
    listing missing parameters, shape mismatches and (when strict) unexpected names."""
    dev = torch.device(device or "cpu")
    params = dict(model.named_parameters())
    owners = _owners(model)
    seen: set[str] = set()
    unexpected, bad_shape = [], []
    quantized = _quantized_weights(params, owners)
    arena = _weight_arena((p for p in params.values() if id(p) not in quantized), dev)
    fp8_arena = _fp8_arena((p for p in params.values() if id(p) in quantized), dev)
    with torch.no_grad():
        for name, tensor in weights:
            p = params.get(name)
            if p is None:
                unexpected.append(name)
                continue
            if tuple(p.shape) != tuple(tensor.shape):
                bad_shape.append(f"{name}: checkpoint {tuple(tensor.shape)} vs {tuple(p.shape)}")
                continue
            if id(p) in quantized:  # the weight becomes its Fp8Weight
                mod, leaf = quantized.pop(id(p))
                delattr(mod, leaf)  # (a module cannot take a parameter's name)
                setattr(mod, leaf, _quantize_into(p, tensor, fp8_arena, dev))
                owners.pop(id(p))
            elif p.is_meta:
                new = _materialise(p, tensor, dev, arena)
                for mod, leaf in owners.pop(id(p)):
                    mod._parameters[leaf] = new
                owners[id(new)] = []
                params[name] = new
            else:
                if isinstance(tensor, Lazy) and p.device.type == "cpu":
                    tensor.read_into(p)
                else:
                    p.copy_(materialised(tensor).to(dtype=p.dtype, device=p.device))
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
    weights: Iterable[tuple[str, torch.Tensor | Lazy]], merges: dict[str, tuple[str, ...]]
) -> Iterator[tuple[str, torch.Tensor | Lazy]]:
    """Concatenate (dim 0, lazily: a ``Concat``) the weights (and biases) of sibling linears
    into one fused module.

    ``merges`` maps a fused module name to its parts, e.g. ``{"gate_up_proj": ("gate_proj",
    "up_proj")}``: ``X.gate_proj.weight`` + ``X.up_proj.weight`` -> ``X.gate_up_proj.weight``.
    Names under ``.experts.<n>.`` are never merged. A group is held only until its last part
    arrives (then its parts are dropped); incomplete groups pass through unchanged at the end.
    """
    part_of = {part: (fused, parts) for fused, parts in merges.items() for part in parts}
    pending: dict[tuple[str, str, str], dict[str, torch.Tensor | Lazy]] = {}

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
            yield join(mod_prefix, fused, leaf), Concat([group.pop(p) for p in parts])
    for (mod_prefix, _, leaf), group in pending.items():
        for mod, t in group.items():
            yield join(mod_prefix, mod, leaf), t
