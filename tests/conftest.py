"""Fixtures of the whole suite, and how it runs in parallel.

The suite runs in pytest-xdist workers (``-n auto --maxprocesses 4 --dist loadgroup``, the
README's command and ``.ci/run``): every test has its own folders, catalogs, services and
sockets, so workers share nothing but the machine (``LONG_FIRST`` says in what order they
take the tests). Tests that start Ray are marked
``xdist_group("ray")`` and run one after another in one worker: a second local Ray beside
test_cluster_ray.py's module-wide cluster would be found by ``ray.init`` and join it. Paths
that hold a Unix socket or a ``$TMPDIR`` come from ``short_tmp``: xdist's workers put
``tmp_path`` deeper, past the 107 bytes of a socket's path.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import catalog
from catalog import _progress

# pytest keeps each test module with its asserts rewritten in __pycache__ (gitignored), unless
# bytecode is not to be written (PYTHONDONTWRITEBYTECODE, set on the shared machines): then
# every xdist worker rewrote and compiled all ~200 test modules at each run, ~4 s of a core
# each. This process only (the interpreters the tests start keep their environment).
sys.dont_write_bytecode = False

# The files of the longest tests outside the xdist groups (a benchmark, a script, mypy, the
# README's commands or a service in subprocesses; a rank's timeout: 3-12 s a test), moved to
# the front of the collection. ``--dist loadgroup`` hands out the groups first, then the other
# tests one at a time in collection order, where these came last (tests/test_*.py) or late:
# one of them at the end kept a worker busy for its whole length while the other had nothing
# left to run. Short tests are left for the end, where they even out the two workers.
LONG_FIRST = (
    "tests/tabloader/test_analyze.py",
    "tests/tabloader/test_bench_",
    "tests/tabloader/test_chaos.py",
    "tests/tabloader/test_rank_timeout.py",
    "tests/tabloader/test_service",  # test_service.py, test_service_faults.py
    "tests/tabloader/test_torch.py",
    "tests/test_examples.py",
    "tests/test_lint.py",
    "tests/test_readme.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``LONG_FIRST`` files first, in their order; the others after, in theirs."""
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    """No progress bars, no catalog and no data-parallel rank from the environment in tests."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")
    for name in ("TABLOADER_CATALOG", *launcher, "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TABLOADER_STORAGE", raising=False)  # parts from each catalog's folder
    monkeypatch.setenv("TABLOADER_DISABLE_PROGRESS_BARS", "1")
    _progress.disable_progress_bars()


@pytest.fixture
def short_tmp():
    """An empty folder of a short path (under /tmp), removed after: for a $TMPDIR or a catalog
    whose sockets must fit the 107 bytes of a Unix socket's path, however deep pytest's own
    folders are (deeper under xdist's workers)."""
    path = Path(tempfile.mkdtemp(prefix="tl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def copy_catalog(template: Path, dest: Path) -> Path:
    """A closed catalog ``template`` copied to ``dest`` (its files dated now, as if written
    there): opening a copy costs under half of creating a catalog or importing into one."""
    shutil.copytree(template, dest, copy_function=shutil.copy)
    return dest


@pytest.fixture(scope="session")
def empty_catalog(tmp_path_factory):
    """An empty catalog, created once per test run (closed): ``cat`` opens a copy."""
    root = tmp_path_factory.mktemp("empty-catalog") / "cat"
    with catalog.open_catalog(root, create=True):
        pass
    return root


@pytest.fixture
def cat(tmp_path, empty_catalog):
    """A fresh catalog in a temporary directory (a copy of ``empty_catalog``, the same bytes
    a create writes: 237 tests take one)."""
    with catalog.open_catalog(copy_catalog(empty_catalog, tmp_path / "cat"), create=True) as c:
        yield c


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """A small generated ImageNet-like image folder (real JPEGs)."""
    from tabloader.datagen import make_imagefolder

    root = tmp_path_factory.mktemp("images") / "folder"
    return make_imagefolder(root, num_images=60, num_classes=4, size=(120, 90), seed=1)


@pytest.fixture(scope="session")
def image_catalog(tmp_path_factory, image_folder):
    """A catalog holding ``image_folder`` as dataset ``imgs``, imported once per test run.

    Never open it: tests take a copy (``image_cat_dir``), which costs a tenth of an import.
    """
    root = tmp_path_factory.mktemp("image-catalog") / "cat"
    with catalog.open_catalog(root) as cat:
        cat.import_imagefolder("imgs", image_folder)
    return root


@pytest.fixture
def image_cat_dir(tmp_path, image_catalog):
    """This test's own copy of ``image_catalog``, at ``tmp_path / "cat"`` (closed)."""
    root = tmp_path / "cat"
    shutil.copytree(image_catalog, root)
    return root
