"""The faces of the package: the only modules whose names are public, each with a curated,
sorted ``__all__`` (as httpx's tests/test_exported_members.py checks); everything else is
``_``-prefixed (a private module, or a module inside a private package) and may change without
notice."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import tabloader

FACES = [
    "tabloader",
    "tabloader.analyze",
    "tabloader.catalog",
    "tabloader.catalog.storage",
    "tabloader.cluster",
    "tabloader.engine",
    "tabloader.engine.decode",
    "tabloader.integrations",
    "tabloader.integrations.accelerate",
    "tabloader.integrations.transformers",
    "tabloader.sampling",
    "tabloader.service",
    "tabloader.torch",
]
# Public modules that are entry points rather than faces: no __all__ to curate.
ENTRY_POINTS = ["tabloader.__main__", "tabloader.cli", "tabloader.datagen"]
MAX_PUBLIC_MODULES = 25


def isort_key(name: str) -> tuple[int, str]:
    """ruff's order of ``__all__`` (RUF022): CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


def public_modules() -> list[str]:
    found = ["tabloader"]
    for m in pkgutil.walk_packages(tabloader.__path__, prefix="tabloader."):
        if not any(part.startswith("_") and part != "__main__" for part in m.name.split(".")):
            found.append(m.name)
    return sorted(found)


def test_the_public_modules_are_the_faces_and_entry_points():
    assert public_modules() == sorted(FACES + ENTRY_POINTS)
    assert len(public_modules()) <= MAX_PUBLIC_MODULES


@pytest.mark.parametrize("face", FACES)
def test_each_face_has_a_sorted_all_naming_what_it_has(face):
    module = importlib.import_module(face)
    names = module.__all__
    assert names in (sorted(names), sorted(names, key=isort_key)), f"{face}.__all__ is not sorted"
    assert len(set(names)) == len(names), f"{face}.__all__ repeats a name"
    for name in names:
        assert not name.startswith("_") or name == "__version__", f"{face} exports {name}"
        assert hasattr(module, name), f"{face}.__all__ names {name}, which it lacks"


def test_import_tabloader_catalog_loads_no_engine_service_or_torch():
    """The catalog is the bottom layer: importing it (and its SQL and importers) loads nothing
    else of tabloader but the package's face (and its lazy imports) and the service's plug-in seam
    (where the package registers how a Ray worker finds its node's loader: two modules of
    protocols), and never
    torch."""
    code = (
        "import sys, tabloader.catalog, tabloader.catalog._sql, tabloader.catalog._importers.hf,"
        " tabloader.catalog._importers.imagefolder;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tabloader', 'torch')"
        " and not m.startswith('tabloader.catalog')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(
        ["tabloader", "tabloader._lazy", "tabloader.service", "tabloader.service._plugins"]
    )
