"""The step costs ``--speculative-adaptive`` measured, kept across restarts
(``--speculative-adaptive-costs``).

Why: a fresh process knows no step cost, so the policy spends its first steps trying and
confirming shapes (the first verify step of a process took 392 ms against ~140-190 steady on
the AVX2 EPYC); over 48 new tokens that held the repeat workload at 0.77-0.96x of the fixed full
draft. A restarted engine on the same machine, model and settings starts from the costs its
predecessor measured: each shape's last ``SAMPLES`` step times, which the new process's own
steps then replace one by one (a shape's cost is their median, so a first dear step moves
nothing).

The file is JSON (never unpickled), read at start and written whole at shutdown (a temporary
file renamed over it). It names what the costs depend on (``cost_key``: the CPU's model and
feature flags as the native kernels' cache names them, its cores and the thread count, the
model's parameter shapes and dtype, the kernel backend, device, page size, decode graphs, the
speculative algorithm, k and token map); a file whose key differs is
ignored, as is one that is too large, malformed or holds a sample out of range: a bad file
costs a fresh start, never the engine. Where it lives: ``--speculative-adaptive-costs PATH``,
or by default ``<$MAMBARADIX_SPEC_COSTS or ~/.cache/mambaradix/spec-costs>/<key digest>.json``;
``none`` keeps nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from mambaradix.engine.spec_policy import SAMPLES, StepCosts
from mambaradix.kernels.native_build import cpu_id
from mambaradix.models.loader import cache_root

logger = logging.getLogger(__name__)

VERSION = 1
MAX_BYTES = 1 << 20  # a larger file is not ours
MAX_SHAPES = 4096  # (batch, rows) entries a file may hold
MAX_ROWS = 1 << 20  # batch and rows bounds
MAX_SECONDS = 3600.0  # a step time beyond this is not one


def cost_key(cfg: Any, model: torch.nn.Module, backend: str) -> dict[str, Any]:
    """What the step costs of this engine depend on; equal keys, comparable costs."""
    shapes = hashlib.sha256()
    for name, p in model.state_dict().items():
        shapes.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return {
        "cpu": hashlib.sha256(cpu_id().encode()).hexdigest()[:32],  # model and features
        "cores": os.cpu_count() or 0,
        "threads": torch.get_num_threads(),
        "model": shapes.hexdigest()[:32],
        "backend": backend,
        "device": cfg.device,
        "page_size": cfg.page_size,
        "decode_graphs": not (cfg.disable_decode_graph or cfg.disable_cuda_graph),
        "algorithm": cfg.speculative_algorithm,
        "k": cfg.speculative_num_steps,
        "token_map": cfg.speculative_token_map,
    }


def cost_path(setting: str, key: dict[str, Any]) -> Path | None:
    """The file for ``--speculative-adaptive-costs`` = ``setting`` ('' the default place,
    'none' no file)."""
    if setting == "none":
        return None
    if setting:
        return Path(setting).expanduser()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    env = os.environ.get("MAMBARADIX_SPEC_COSTS")
    folder = Path(env) if env else cache_root() / "spec-costs"
    return folder / f"{digest}.json"


def load(path: Path, key: dict[str, Any], costs: StepCosts) -> int:
    """The samples of ``path`` into ``costs`` if the file is sound and its key is ``key``;
    the number of shapes taken (0: none, a warning says why when the file was unusable)."""
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        doc = json.loads(path.read_text(encoding="utf-8"))
        shapes = _checked(doc, key)
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        logger.warning("speculative step costs: %s ignored (%s)", path, e)
        return 0
    for batch, rows, samples in shapes:
        for s in samples:
            costs.observe(batch, rows, s)
    return len(shapes)


def _checked(doc: Any, key: dict[str, Any]) -> list[tuple[int, int, list[float]]]:
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError("not a version-1 step cost file")
    if doc.get("key") != key:
        raise ValueError("measured for another machine, model or setting")
    shapes = doc.get("shapes")
    if not isinstance(shapes, list) or len(shapes) > MAX_SHAPES:
        raise ValueError(f"no list of at most {MAX_SHAPES} shapes")
    out = []
    for entry in shapes:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ValueError("a shape is not [batch, rows, samples]")
        batch, rows, samples = entry
        if not all(type(v) is int for v in (batch, rows)) or not 1 <= batch <= rows <= MAX_ROWS:
            raise ValueError(f"shape {batch!r} x {rows!r} out of range")
        if not isinstance(samples, list) or not 1 <= len(samples) <= SAMPLES:
            raise ValueError(f"shape {batch} x {rows}: not 1 to {SAMPLES} samples")
        for s in samples:
            if type(s) not in (int, float) or not math.isfinite(s) or not 0 < s <= MAX_SECONDS:
                raise ValueError(f"shape {batch} x {rows}: sample {s!r} out of range")
        out.append((batch, rows, [float(s) for s in samples]))
    return out


def save(path: Path, key: dict[str, Any], costs: StepCosts) -> None:
    """``costs``' samples to ``path``, whole or not at all (a warning when it cannot)."""
    shapes = [[b, t, list(v)] for b, at in sorted(costs.samples().items()) for t, v in at]
    doc = {"version": VERSION, "key": key, "shapes": shapes[:MAX_SHAPES]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("speculative step costs: could not write %s (%s)", path, e)
        tmp.unlink(missing_ok=True)
