"""Lower layers never import upper ones (design.md sec. 2), checked on every module's imports,
including imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mambaradix"
# package -> packages above it, which it must not import
_ALL = {"cache", "models", "layers", "kernels", "engine", "server", "bench", "cli", "config"}
FORBIDDEN = {
    # the shared vocabulary and the per-forward layout: below every package
    "core.py": _ALL,
    "layout.py": _ALL,
    "cache": {"models", "layers", "kernels", "engine", "server", "bench", "cli"},
    "kernels": {"models", "layers", "engine", "server", "bench", "cli"},
    "layers": {"models", "engine", "server", "bench", "cli"},
    "models": {"engine", "server", "bench", "cli"},
    "engine": {"server", "bench", "cli"},
    "server": {"bench", "cli"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mambaradix" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


MODULES = sorted(
    p
    for pkg in FORBIDDEN
    for p in ([SRC / pkg] if pkg.endswith(".py") else (SRC / pkg).rglob("*.py"))
)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_upward_imports(path: Path) -> None:
    pkg = path.relative_to(SRC).parts[0]
    bad = sorted((p, line) for p, line in imported_packages(path) if p in FORBIDDEN[pkg])
    assert not bad, f"{path.relative_to(SRC)} ({pkg}/) imports from above it: {bad}"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """Negative control: a function-level import of the engine is found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from mambaradix.engine.engine import Engine\n")
    assert ("engine", 2) in imported_packages(f)
