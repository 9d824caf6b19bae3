"""Hostile images in a dataset: refused from their headers in every decode path, remembered,
never decoded again; decode processes under a memory cap; a stopping service frees the
catalog at once."""

from __future__ import annotations

import gc
import io
import re
import resource
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tabloader.engine.decode._images as codec
from tabloader import catalog
from tabloader.catalog._errors import LoaderError, RowReadError
from tabloader.engine import Loader
from tabloader.engine._arena.shm import shm_available
from tabloader.engine._prepare import decoding
from tests.support.bombs import KINDS, bomb
from tests.support.faults import Hungry

SUFFIX = {"progressive": ".jpg", "jpeg": ".jpg", "png": ".png", "webp": ".webp", "gif": ".gif"}
TIMEOUT = 60


@pytest.fixture(autouse=True)
def _default_limit(monkeypatch):
    """The default pixel limit, whatever this environment sets."""
    monkeypatch.delenv("TABLOADER_MAX_IMAGE_MEGAPIXELS", raising=False)


needs_shm = pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")


@pytest.fixture
def bombed(tmp_path, image_folder):
    """``image_folder`` plus one bomb of each kind in class 0: (catalog, {row: kind})."""
    folder = tmp_path / "folder"
    shutil.copytree(image_folder, folder)
    cls = sorted(p for p in folder.iterdir() if p.is_dir())[0]
    for kind in KINDS:
        (cls / f"zz-{kind}{SUFFIX[kind]}").write_bytes(bomb(kind))
    cat = catalog.open_catalog(tmp_path / "cat")
    ds = cat.import_imagefolder("imgs", folder)
    paths = ds.take(list(range(ds.num_rows)), ["path"]).column("path").to_pylist()
    rows = {i: p.split("zz-")[1].split(".")[0] for i, p in enumerate(paths) if "zz-" in p}
    assert sorted(rows.values()) == sorted(KINDS)
    yield cat, rows
    cat.close()


@pytest.fixture
def no_bomb_decoded(monkeypatch):
    """Fails the test if a decoder of this process was handed a bomb's bytes (it is not called
    with them: a bomb must not run even in a test that fails)."""
    bombs = {bomb(kind) for kind in KINDS}
    handed: list[str] = []
    real_jpeg, real_open = codec.simplejpeg.decode_jpeg, codec.Image.open

    def decode_jpeg(data, *args, **kw):
        if bytes(data) in bombs:
            handed.append("simplejpeg")
            raise ValueError("a bomb reached simplejpeg")
        return real_jpeg(data, *args, **kw)

    def open_(fp, *args, **kw):
        if isinstance(fp, io.BytesIO) and fp.getvalue() in bombs:
            handed.append("PIL")
            raise ValueError("a bomb reached PIL")
        return real_open(fp, *args, **kw)

    monkeypatch.setattr(codec.simplejpeg, "decode_jpeg", decode_jpeg)
    monkeypatch.setattr(codec.Image, "open", open_)
    yield
    assert handed == []


def _epoch(loader, job, **kw):
    """One epoch of ``job``: ({row: image}, the stream's stats)."""
    with loader.open(job, epochs=1, batch_size=8, **kw) as stream:
        got = {int(i): img for b in stream for i, img in zip(b["_id"], b["image"], strict=True)}
        return got, stream.stats()


PATHS = {
    "threads": ({"decode": "threads"}, "image_size = 16"),
    "processes": ({}, "image_size = 16"),
    "into-slot": ({"decode": "threads"}, "augment = 'RandomResizedCrop(16)'"),
}


@needs_shm
@pytest.mark.parametrize("path", sorted(PATHS))
def test_bombs_are_skipped_from_their_headers_in_every_decode_path(bombed, no_bomb_decoded, path):
    cat, bombs = bombed
    loader_kw, options = PATHS[path]
    cat.sql(f"REGISTER JOB j SELECT image FROM imgs WITH ({options}, on_error = 'skip')")
    with Loader(cat, cache_bytes=8 << 20, workers=2, **loader_kw) as loader:
        if path == "processes":
            loader.wait_ready()  # its decode processes run (they start lazily)
            assert loader.decode_pool.status == "running"
        got, stats = _epoch(loader, "j")
        assert stats["skipped"] == len(bombs)
        assert got.keys() == set(range(cat.dataset("imgs").num_rows)) - set(bombs)
        assert all(img.shape == (16, 16, 3) for img in got.values())
        failed = loader.scheduler("imgs").fetcher.failed_rows("image")
        if path != "into-slot":  # a batch that skipped rows holds the others' own values
            bad = ", ".join(map(str, bombs))
            where = f"WHERE _id NOT IN ({bad})"
            cat.sql(f"REGISTER JOB k SELECT image FROM imgs {where} WITH ({options})")
            clean, _ = _epoch(loader, "k")
            assert all(np.array_equal(got[row], clean[row]) for row in clean)
    assert failed.keys() == bombs.keys()
    for row, message in failed.items():
        assert f"row {row}, column 'image': the image declares" in message
        assert "refused before decoding" in message


@needs_shm
def test_a_bomb_raises_naming_the_row_its_size_the_limit_and_the_fix(bombed):
    cat, bombs = bombed
    (row,) = [r for r, kind in bombs.items() if kind == "progressive"]
    cat.sql(f"REGISTER JOB j SELECT image FROM imgs WHERE _id = {row} WITH (image_size = 16)")
    with Loader(cat, cache_bytes=8 << 20, workers=2) as loader:
        with pytest.raises(
            RowReadError,
            match=rf"row {row}, column 'image': the image declares 65500x65500 pixels "
            r"\(4290\.2 megapixels\), over the limit of 64 megapixels, so it was refused before "
            r"decoding .* raise the limit \(tabloader serve --max-image-megapixels N",
        ) as info:
            _epoch(loader, "j")
        assert info.value.row_id == row


@needs_shm
def test_a_failed_row_is_not_read_again_in_later_epochs_nor_by_other_jobs(bombed, no_bomb_decoded):
    cat, bombs = bombed
    n = cat.dataset("imgs").num_rows
    cat.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16, on_error = 'skip')")
    cat.sql("REGISTER JOB b SELECT image FROM imgs WITH (image_size = 12, on_error = 'skip')")
    cat.sql("REGISTER JOB c SELECT image FROM imgs WITH (image_size = 12)")
    with Loader(cat, cache_bytes=8 << 20, workers=2, decode="threads") as loader:
        _epoch(loader, "a")
        assert loader.stats()["reads"] == n  # every row once, the bombs too
        got, stats = _epoch(loader, "a")  # epoch 2: all cached, the bombs remembered
        assert (len(got), stats["skipped"]) == (n - len(bombs), len(bombs))
        assert loader.stats()["reads"] == n
        got, stats = _epoch(loader, "b")  # another size: decodes again, but not the bombs
        assert (len(got), stats["skipped"]) == (n - len(bombs), len(bombs))
        assert loader.stats()["reads"] == n + n - len(bombs)
        assert loader.stats()["decodes"] == 2 * (n - len(bombs))
        with pytest.raises(RowReadError, match="It failed when first read; it is not read again"):
            _epoch(loader, "c")  # on_error = 'raise': at once
        assert loader.stats()["reads"] == n + n - len(bombs)


@needs_shm
def test_a_skipped_row_is_logged_once_per_job_not_every_epoch(bombed, no_bomb_decoded, caplog):
    """A bad row is skipped again every epoch; its warning comes once a job (a line per bomb
    per epoch was most of what a job beside bombs cost its neighbours)."""
    cat, bombs = bombed
    cat.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16, on_error = 'skip')")
    cat.sql("REGISTER JOB b SELECT image FROM imgs WITH (image_size = 16, on_error = 'skip')")
    with Loader(cat, cache_bytes=8 << 20, workers=2, decode="threads") as loader:
        for _ in range(3):
            assert _epoch(loader, "a")[1]["skipped"] == len(bombs)
        assert _epoch(loader, "b")[1]["skipped"] == len(bombs)
    lines = [r.getMessage() for r in caplog.records if "skipped a row" in r.getMessage()]
    jobs = sorted(line.split()[1].strip("'") for line in lines)
    assert jobs == ["a"] * len(bombs) + ["b"] * len(bombs)


@needs_shm
def test_a_loader_takes_its_own_pixel_limit(images, monkeypatch):
    monkeypatch.setenv("TABLOADER_MAX_IMAGE_MEGAPIXELS", "7")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        assert loader.max_pixels == 7_000_000
        assert loader.decode_pool.max_pixels == 7_000_000
    with Loader(images, cache_bytes=8 << 20, workers=2, max_image_megapixels=500) as loader:
        assert loader.max_pixels == loader.decode_pool.max_pixels == 500_000_000
    with pytest.raises(LoaderError, match="max_image_megapixels 0 is below the range"):
        Loader(images, max_image_megapixels=0)


# -- the decode processes' memory cap --------------------------------------------------------
@needs_shm
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is Linux's")
def test_decode_processes_run_under_a_memory_cap_sized_from_the_pixel_limit(images):
    with Loader(images, cache_bytes=8 << 20, workers=1, max_image_megapixels=10) as loader:
        pool = loader.decode_pool
        executor = pool.executor()
        cap, _ = executor.submit(resource.getrlimit, resource.RLIMIT_DATA).result(TIMEOUT)
        used = executor.submit(decoding.data_bytes).result(TIMEOUT)
    room = decoding.CAP_HEADROOM + decoding.CAP_BYTES_PER_PIXEL * 10_000_000
    assert used < cap <= used + room  # what it used at its start, plus the room
    assert cap > used + room * 0.9
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    assert soft == resource.RLIM_INFINITY or soft != cap  # the loader itself is not capped


@needs_shm
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_DATA is Linux's")
def test_a_decode_that_reaches_the_cap_ends_its_process_and_is_bad_data_alone(images, monkeypatch):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    ids = images.job("j").ids
    hungry = int(ids[len(ids) // 3])
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        real = loader.decode_pool.submit

        def submit(reader, dec, rows, offsets):
            wrapped = Hungry(
                column=dec.column, kind=dec.kind, image_size=dec.image_size, row=hungry
            )
            return real(reader, wrapped, rows, offsets)

        monkeypatch.setattr(loader.decode_pool, "submit", submit)
        got, stats = _epoch(loader, "j", on_error="skip")
        assert stats["skipped"] == 1
        assert got.keys() == set(ids) - {hungry}
        failed = loader.scheduler("imgs").fetcher.failed_rows("image")
    assert list(failed) == [hungry]
    assert "killed a decode process 2 times (a crash, or its memory cap)" in failed[hungry]


def test_out_of_memory_in_a_thread_is_not_bad_data(images, monkeypatch):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    victim = int(images.job("j").ids[0])
    real = codec.decode_pixels
    raw = images.dataset("imgs").take([victim], ["image"]).column("image")[0].as_py()
    once = []

    def decode(data, *args, **kw):
        if bytes(data) == raw and not once:
            once.append(1)
            raise MemoryError
        return real(data, *args, **kw)

    monkeypatch.setattr(codec, "decode_pixels", decode)
    with Loader(images, cache_bytes=8 << 20, workers=2, decode="threads") as loader:
        got, stats = _epoch(loader, "j", on_error="skip")
        assert stats["skipped"] == 1
        assert victim not in got
        assert loader.scheduler("imgs").fetcher.failed_rows("image") == {}
        got, stats = _epoch(loader, "j", on_error="skip")  # decoded again: it was not the row
        assert victim in got
        assert stats["skipped"] == 0


# -- a stopping service ------------------------------------------------------------------------
# Connects once the stopping service has let go (it may still be closing when this starts):
# the test's point is that this happens while the work in flight still runs.
CONNECT = """
import sys, time
from tabloader import catalog
from tabloader.catalog._errors import CatalogLockedError
deadline = time.monotonic() + 30
while True:
    try:
        catalog.open_catalog(sys.argv[1]).close()
        break
    except CatalogLockedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print("ok")
"""


@needs_shm
def test_a_stopping_service_frees_the_catalog_before_its_work_in_flight_ends(image_cat_dir):
    from tabloader.service._server import Service

    service = Service(image_cat_dir, cache_bytes=16 << 20, workers=2, idle_exit=0.0)
    in_flight = threading.Event()
    release = threading.Event()

    def slow_decode():  # as a decode of a bomb in a thread, before this change: minutes
        in_flight.set()
        release.wait(TIMEOUT)

    service.loader._pool.submit(slow_decode)
    assert in_flight.wait(TIMEOUT)
    serving = threading.Thread(target=service.serve)  # no client: it stops at once (idle)
    serving.start()
    try:
        done = subprocess.run(
            [sys.executable, "-c", CONNECT, str(image_cat_dir)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert done.stdout.strip() == "ok", done.stderr
        assert serving.is_alive()  # still waiting for the decode in flight: the lock is free
    finally:
        release.set()
        serving.join(TIMEOUT)
        gc.unfreeze()  # serve() froze this process's objects
    assert not serving.is_alive()


def test_a_large_decoded_image_is_resized_at_once_not_kept_for_a_batch(monkeypatch):
    batched = []
    real = codec.resize_many_hw

    def resize_many_hw(src, h, w):
        batched.append(src.shape)
        return real(src, h, w)

    monkeypatch.setattr(codec, "resize_many_hw", resize_many_hw)
    big, small = io.BytesIO(), io.BytesIO()
    codec.Image.fromarray(np.zeros((1100, 1500, 3), np.uint8)).save(big, "PNG")
    codec.Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(small, "PNG")
    assert codec.BATCH_RESIZE_BYTES < 1100 * 1500 * 3
    values = [big.getvalue(), small.getvalue()] * 2
    got = codec.decode_images(values, size=16)
    assert all(isinstance(g, np.ndarray) and g.shape == (16, 16, 3) for g in got)
    assert batched == [(2, 30, 30, 3)]  # the small ones' center squares only


@needs_shm
def test_through_the_service_a_bomb_is_skipped_or_raised_and_read_once(bombed, tmp_path):
    from tabloader.service._client import RemoteLoader

    cat, bombs = bombed
    n = cat.dataset("imgs").num_rows
    cat.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16, on_error = 'skip')")
    cat.sql("REGISTER JOB b SELECT image FROM imgs WITH (image_size = 12)")
    cat.close()
    with open(tmp_path / "serve.log", "ab") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tabloader", "--catalog", str(cat.root), "serve"),
                *("--workers", "2", "--cache-bytes", str(16 << 20)),
                *("--max-image-megapixels", "100"),
            ],
            stderr=log,
        )
    try:
        remote = _connect(RemoteLoader, cat.root, proc)
        with remote:
            with remote.open("a", batch_size=8, epochs=1) as stream:
                rows = [int(i) for batch in stream for i in batch["_id"]]
                assert stream.stats()["skipped"] == len(bombs)
            assert sorted(rows) == sorted(set(range(n)) - set(bombs))
            assert remote.stats()["reads"] == n
            stream = remote.open("b", batch_size=n, epochs=1)
            with pytest.raises(RowReadError, match="It failed when first read") as info:
                next(iter(stream))
            stream.close()
            assert info.value.row_id in bombs
            assert "over the limit of 100 megapixels" in str(info.value)
            assert remote.stats()["reads"] == n + n - len(bombs)
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)


def _connect(remote_loader, root, proc):
    """A client of the service ``proc`` once it answers."""
    from tabloader.catalog._errors import ServiceError

    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return remote_loader(root, start=False)
        except ServiceError:
            assert proc.poll() is None, "the service exited"
            assert time.monotonic() < deadline, "the service did not answer"
            time.sleep(0.05)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--max-image-megapixels", "0"], r"--max-image-megapixels '0' is below the range"),
        (["--max-image-megapixels", "x"], r"--max-image-megapixels 'x' is not a whole number"),
        (
            ["--max-image-megapixels", "100", "--ray", "127.0.0.1:1"],
            r"for a Ray cluster set \$TABLOADER_MAX_IMAGE_MEGAPIXELS in every node",
        ),
    ],
)
def test_serve_refuses_a_bad_pixel_limit(tmp_path, capsys, args, match):
    from tabloader.cli import main

    assert main(["--catalog", str(tmp_path), "serve", *args]) == 1
    assert re.search(match, capsys.readouterr().err)
