"""Lower layers never import upper ones (design.md sec. 2), checked on every module's imports,
including imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mambaradix"
# package or top-level module -> what sits above it, which it must not import
_UPPER = {"engine", "server", "bench", "cli"}
_ALL = {"cache", "models", "layers", "kernels", "config", *_UPPER}
FORBIDDEN = {
    # the shared vocabulary, the per-forward layout and the stats record: below every package
    "core.py": _ALL,
    "layout.py": _ALL,
    "stats.py": _ALL | {"core", "layout"},
    # host memory (pools' mappings, the weights' huge-page arena): used by cache/ and models/
    "host_memory.py": _ALL | {"core", "layout", "stats"},
    "cache": {"models", "layers", "kernels", "config", *_UPPER},
    "kernels": {"models", "layers", "config", *_UPPER},
    "layers": {"models", "config", *_UPPER},
    "models": {"config", *_UPPER},
    "config.py": {"cache", "models", "layers", *_UPPER},  # reads the backend registry only
    "engine": {"server", "bench", "cli"},
    "server": {"bench", "cli"},
    "bench": {"cli"},
}
# the package's lazy entry point, the top of it all, and the flag reference made from cli's parser
UNCHECKED = {"__init__.py", "cli.py", "flags_doc.py"}


def imported_packages(path: Path, source: str | None = None) -> set[tuple[str, int]]:
    """(package or top-level module under mambaradix, line) of every import in ``path`` (or in
    ``source``, as if it were that file), relative imports resolved against its package."""
    inside = path.is_relative_to(SRC)
    package = ["mambaradix", *path.relative_to(SRC).parts[:-1]] if inside else ["mambaradix"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = [*base, *(node.module or "").split(".")] if node.module else base
            names = [".".join(mod)]
            if not node.module:  # ``from . import x``: the names are the modules
                names = [".".join([*mod, a.name]) for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mambaradix" and len(parts) > 1:
                found.add((parts[1].removesuffix(".py"), node.lineno))
    return found


def _owner(path: Path) -> str:
    return path.relative_to(SRC).parts[0]


MODULES = sorted(p for p in SRC.rglob("*.py") if _owner(p) not in UNCHECKED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_upward_imports(path: Path) -> None:
    owner = _owner(path)
    assert owner in FORBIDDEN, f"{owner}: a new package or module; give it a place in FORBIDDEN"
    bad = sorted(
        (p, line) for p, line in imported_packages(path) if p in FORBIDDEN[owner] and p != owner
    )
    assert not bad, f"{path.relative_to(SRC)} ({owner}) imports from above it: {bad}"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """Negative control: a function-level import of the engine is found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from mambaradix.engine.engine import Engine\n")
    assert ("engine", 2) in imported_packages(f)


def test_the_check_resolves_relative_imports() -> None:
    """Negative control: ``from ..engine import x`` inside kernels/ is an import of engine."""
    source = "from ..engine.engine import Engine\nfrom . import conv\nfrom .. import server\n"
    found = imported_packages(SRC / "kernels" / "m.py", source)
    assert {("engine", 1), ("kernels", 2), ("server", 3)} <= found
