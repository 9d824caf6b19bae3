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

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tabloader import catalog
from tabloader.catalog import _progress
from tabloader.datagen import corrupt_image
from tests.support.service import TIMEOUT, start_service

# pytest keeps each test module with its asserts rewritten in __pycache__ (gitignored), unless
# bytecode is not to be written (PYTHONDONTWRITEBYTECODE, set on the shared machines): then
# every xdist worker rewrote and compiled all ~200 test modules at each run, ~4 s of a core
# each. This process only (the interpreters the tests start keep their environment).
sys.dont_write_bytecode = False

# The files of the longest tests outside the xdist groups (a benchmark, a script, mypy, the
# README's commands or services in subprocesses, a rank's timeout: 3-35 s a test), moved to
# the front of the collection, longest first. ``--dist loadgroup`` hands out the groups first
# (pytest-xdist orders its units by their number of tests: docs, ray, frameworks), then the
# other tests one at a time in collection order, where these came late: one of them at the
# end kept a worker busy for its whole length while the other had nothing left to run. Short
# tests are left for the end, where they even out the two workers.
LONG_FIRST = (
    "tests/service/test_catalog_lock.py",  # 16 processes at once, three times
    "tests/benchmarks/test_bench_",
    "tests/test_examples.py",
    "tests/service/test_service",  # test_service.py, test_service_faults.py, _storage.py
    "tests/test_lint.py",  # mypy --strict: ~25 s in a fresh clone (no .mypy_cache)
    "tests/analyze/test_analyze.py",
    "tests/service/test_chaos.py",
    "tests/service/test_rank_timeout.py",
    "tests/test_torch.py",
)


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) knows no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: a worker more than this machine has CPUs (xdist's own gives one a CPU).
    Most long tests wait on processes they started (a service, a framework's ranks, Ray) or on
    a timeout, so with one a CPU the cores were idle 12% of the suite (2 cores: 1.76 busy on
    average, 388 s); a third worker fills that (1.94 busy, 375 s), and ``--maxprocesses``
    still caps it. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` is xdist's to read."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(os.sched_getaffinity(0)) + 1


def _rank(item: pytest.Item) -> int:
    """Where ``item``'s file stands in ``LONG_FIRST`` (after all of it if it is not there)."""
    return next(
        (i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)),
        len(LONG_FIRST),
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``LONG_FIRST`` files first, in its order; the others after, in theirs. Under
    ``--dist loadgroup``, each test of an ``xdist_group`` in its group (``_join_group``)."""
    items.sort(key=_rank)
    if getattr(config.option, "loadgroup", False):  # an xdist worker's collection
        for item in items:
            _join_group(item)


def _join_group(item: pytest.Item) -> None:
    """The ``@name`` suffix of ``item``'s id that puts it in its ``xdist_group``, where
    pytest-xdist's own did not take: xdist (3.8) writes it to ``item._nodeid``, which pytest
    9.2 no longer reads (its ids are ``NodeId`` objects), so the groups silently ran on every
    worker at once (pytest-dev/pytest-xdist#1386): two Ray clusters side by side, each
    worker its own copy of a module's services and catalogs."""
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})  # fmt: skip
    nodeid = item.nodeid
    if not names or nodeid.rfind("@") > nodeid.rfind("]"):  # none, or xdist's took
        return
    from _pytest.nodeid import NodeId

    item._id = NodeId.parse(f"{nodeid}@{'_'.join(names)}")


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
def tier_images(tmp_path_factory):
    """80 JPEGs of about 24 KB: the storage tier's tests import them a record batch a row
    (``tests.engine.test_storage_tier.bucket_dataset``)."""
    from tabloader.datagen import make_imagefolder

    root = tmp_path_factory.mktemp("tier-images") / "folder"
    return make_imagefolder(root, num_images=80, num_classes=4, size=(256, 192), seed=3)


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


def register_jobs(root: Path) -> Path:
    """Jobs ``a`` (16x16 images of labels 0-2), ``b`` (labels 1-3) and ``c0`` (labels 0-1, no
    images) in the closed catalog at ``root``."""
    with catalog.open_catalog(root) as cat:
        cat.sql(
            "REGISTER JOB a SELECT image, label FROM imgs WHERE label < 3 WITH (image_size = 16)"
        )
        cat.sql(
            "REGISTER JOB b SELECT image, label FROM imgs WHERE label > 0 WITH (image_size = 16)"
        )
        cat.sql("REGISTER JOB c0 SELECT label FROM imgs WHERE label < 2")  # no images
    return root


@pytest.fixture
def cat_dir(image_cat_dir):
    return register_jobs(image_cat_dir)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


@pytest.fixture
def service(cat_dir):
    proc = start_service(cat_dir)
    yield proc
    _stop(proc)


@dataclass
class Served:
    """A module's service (``proc``) of ``cat_dir``'s jobs, in the catalog at ``root``."""

    proc: subprocess.Popen
    root: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory, image_catalog):
    """One service that a module's tests take turns on, for tests that only ask it something
    and leave it as they found it (no job left open, no job registered): a service of a
    test's own cost each of them most of its CPU (~1 CPU-s: the service, its decode
    processes)."""
    root = tmp_path_factory.mktemp("served") / "cat"
    shutil.copytree(image_catalog, root)
    proc = start_service(register_jobs(root))
    yield Served(proc, root)
    _stop(proc)


@pytest.fixture
def images(image_cat_dir):
    """An open catalog holding ``image_folder`` as ``imgs`` (this test's own copy)."""
    cat = catalog.open_catalog(image_cat_dir)
    yield cat
    cat.close()


@pytest.fixture
def corrupt(tmp_path, image_folder):
    """``images`` with one JPEG corrupted before the import: (catalog, that row's ``_id``)."""
    folder = tmp_path / "folder"
    shutil.copytree(image_folder, folder)
    victim = sorted(folder.rglob("*.jpg"))[0]
    corrupt_image(victim)
    cat = catalog.open_catalog(tmp_path / "cat")
    ds = cat.import_imagefolder("imgs", folder)
    paths = ds.take(list(range(ds.num_rows)), ["path"]).column("path").to_pylist()
    yield cat, paths.index(victim.relative_to(folder).as_posix())
    cat.close()


@pytest.fixture(params=["kernel", "torch", "pillow"])
def resizer(request, monkeypatch):
    """Each way a resize is computed: tabloader's kernel; torch where the kernel was not
    built; Pillow where torch is missing too."""
    from tabloader.engine._prepare import resample

    if request.param != "kernel":
        monkeypatch.setattr(resample, "kernel", None)
    if request.param == "pillow":
        monkeypatch.setattr(resample, "optional_torch", lambda: None)
    resample.resampler.cache_clear()
    yield request.param
    resample.resampler.cache_clear()


# -- object storage: moto's S3 server on loopback behind our fault-injecting proxy --------------
@pytest.fixture(scope="session")
def loopback_s3_server():
    """moto's S3 server and tests/support/s3proxy.py's proxy in front of it, once per run
    (per xdist worker). Nothing leaves loopback."""
    from tests.support.s3proxy import loopback_s3

    with loopback_s3() as server:
        yield server


@dataclass
class S3Env:
    """What the ``s3`` fixture set up: ``uri`` (``s3://<bucket>``), the proxy (faults, stats)
    and a boto3 client straight to moto (set-up and checks that pass no fault)."""

    url: str
    bucket: str
    proxy: Any
    client: Any

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}"

    def keys(self, prefix: str = "") -> list[str]:
        """The keys of the bucket under ``prefix`` (straight from moto)."""
        listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for o in listed.get("Contents", []))


@pytest.fixture
def s3(loopback_s3_server, monkeypatch, tmp_path):
    """A new bucket of the loopback S3 server; the AWS environment of this test (and of the
    processes it starts) points at the proxy, with test credentials and no profile files."""
    import uuid

    import boto3

    from tabloader.catalog.storage._s3 import forget_stores
    from tests.support.s3proxy import Faults

    server = loopback_s3_server
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    server.proxy.faults = Faults()
    server.proxy.reset()
    client = boto3.client(
        "s3",
        endpoint_url=server.server_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket = f"tl-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    forget_stores()  # (a store of this process read the environment of another test)
    yield S3Env(server.url, bucket, server.proxy, client)
    forget_stores()
    server.proxy.faults = Faults()
