"""Build the optional C extensions; the rest is pyproject.toml.

* ``tabloader.engine._prepare._resample``: the crop-resize-flip kernel;
* ``tabloader.sampling._rounds``: the dependent sampler's walk over several regions.

Both are ``optional``: without a C compiler the install still succeeds; images are then
resized by torch (or Pillow), which :mod:`tabloader.engine._prepare.resample` logs once, and the
sampler walks its rounds in Python (the same rows, ~30x slower per round).
"""

from __future__ import annotations

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffp-contract=off: the weights must be computed exactly as aten computes them, so no fused
# multiply-adds (aarch64 and -march builds would contract a * b + c otherwise).
UNIX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-Wextra"]


class BuildExt(build_ext):
    """Unix compilers get UNIX_FLAGS; others (MSVC) build with their defaults."""

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix":
            for ext in self.extensions:
                ext.extra_compile_args = [*UNIX_FLAGS, *ext.extra_compile_args]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "tabloader.engine._prepare._resample",
            sources=["tabloader/engine/_prepare/_resample.c"],
            optional=True,
        ),
        Extension(
            "tabloader.sampling._rounds",
            sources=["tabloader/sampling/_rounds.c"],
            optional=True,
        ),
    ],
    cmdclass={"build_ext": BuildExt},
)
