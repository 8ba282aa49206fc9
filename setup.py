"""Install-time build of the native CPU kernels; the package's metadata is in pyproject.toml.

``pip install .`` and ``pip install -e .`` compile every ``kernels/csrc/*.c`` into
``mambaradix/kernels/prebuilt/`` (in the wheel, or in the source tree for an editable install),
exactly as the first start would (``kernels/native_build.py``, loaded here by its path: torch
is not installed yet). Without a compiler, or where a library does not compile, the install
goes on and the run time compiles on first use, as it always could.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from setuptools import Command, Distribution, setup
from setuptools.command.build import build

HERE = Path(__file__).parent
KERNELS = Path("mambaradix", "kernels")


def native_build():
    path = HERE / "src" / KERNELS / "native_build.py"
    spec = importlib.util.spec_from_file_location("_mambaradix_native_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernels(Command):
    """Compile the native kernels into the package (a ``build`` sub-command)."""

    description = "compile the native CPU kernels into mambaradix/kernels/prebuilt"
    user_options: list = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False  # set by setuptools for pip install -e: build in place

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def target(self) -> Path:
        root = HERE / "src" if self.editable_mode else Path(self.build_lib)
        return root / KERNELS / "prebuilt"

    def run(self) -> None:
        manifest = native_build().prebuild(self.target())
        built, failed = manifest["libraries"], manifest["failed"]
        note = f"native kernels: {len(built)} built in {manifest['seconds']} s"
        if failed or "error" in manifest:
            problem = manifest.get("error") or "failed: " + ", ".join(failed)
            self.announce(f"{note}; {problem} (compiled on first use instead)", logging.WARNING)
        else:
            self.announce(f"{note} into {self.target()}", logging.INFO)

    def get_outputs(self) -> list[str]:
        return [str(p) for p in self.target().glob("*")] if not self.editable_mode else []

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        csrc = Path("src") / KERNELS / "csrc"
        return sorted(str(csrc / p.name) for p in (HERE / csrc).glob("*.[ch]"))


class Build(build):
    sub_commands = [*build.sub_commands, ("build_kernels", None)]


class BinaryDistribution(Distribution):
    """The wheel holds code compiled for this machine: tag it for this platform."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build": Build, "build_kernels": BuildKernels}, distclass=BinaryDistribution)
