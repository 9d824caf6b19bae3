from __future__ import annotations

import importlib
import pkgutil

import pytest

import catalog
import tabloader

PUBLIC_MODULES = [
    m.name
    for pkg in (catalog, tabloader)
    for m in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + ".")
    if not any(part.startswith("_") for part in m.name.split("."))
]


@pytest.mark.parametrize("package", [catalog, tabloader])
def test_all_is_sorted_and_complete(package):
    names = package.__all__
    assert names == sorted(names)
    public = {n for n in dir(package) if not n.startswith("_")}
    exported_objects = {n for n in public if not isinstance(getattr(package, n), type(catalog))}
    assert exported_objects <= set(names) | {"annotations"}
    for name in names:
        assert hasattr(package, name)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_module_declares_all(module):
    mod = importlib.import_module(module)
    assert hasattr(mod, "__all__"), f"{module} has no __all__"
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.__all__ names missing {name}"


def test_catalog_never_imports_tabloader_or_torch():
    import subprocess
    import sys

    code = (
        "import sys, catalog, catalog.sql, catalog.importers.hf, catalog.importers.imagefolder;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tabloader', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
