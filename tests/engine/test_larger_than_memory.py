"""Larger than memory, locally: a dataset of local files read with its pages dropped from the
page cache between epochs (``POSIX_FADV_DONTNEED``, as if it did not fit in memory) reads each
stored byte about once per epoch for four jobs, and every decode serves every job that wants
the row while the arena holds it."""

from __future__ import annotations

import itertools
import os

import pytest

from tabloader.catalog.storage import _writer
from tabloader.engine import Loader
from tests.engine.test_storage_tier import CACHE, IMAGE_SIZE, ROWS, run

JOBS = ("a", "b", "c", "d")


def drop_pages(paths):
    """Evict the files' pages from the page cache (written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes():
    """Bytes this process read from block storage (``/proc/self/io``; None where absent)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))
    except (OSError, StopIteration):
        return None


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_each_epoch_reads_the_dataset_about_once_with_the_page_cache_dropped(
    cat, tier_images, monkeypatch
):
    monkeypatch.setattr(_writer, "TARGET_BATCH_BYTES", 16 << 10)  # a record batch a row
    ds = cat.import_imagefolder("imgs", tier_images)
    files = [cat.root / p.path for p in ds.reader.parts]
    size = sum(p.file_size for p in ds.reader.parts)
    for name in JOBS:
        cat.sql(
            f"REGISTER JOB {name} SELECT image, label FROM imgs WITH (image_size = {IMAGE_SIZE})"
        )
    union = ROWS  # the jobs' rows together
    marks = []  # (bytes read through the reader, decodes, bytes read from the disk)

    # an arena of 64 decoded rows: less than the dataset's 80, more than what is pinned
    with Loader(cat, cache_bytes=2 * CACHE, workers=2, decode="threads") as loader:

        def between(epoch):
            s = loader.stats()
            marks.append((s["storage"]["local_bytes"], s["decodes"], read_bytes()))
            drop_pages(files)  # the next epoch finds nothing of the dataset in memory

        drop_pages(files)
        marks.append((0, 0, read_bytes()))
        seen = run(loader, list(JOBS), epochs=2, between=between)
    for name in JOBS:
        expected = sorted(cat.job(name).ids)
        assert seen[name] == [expected, expected], name
    # per epoch: bytes read through the reader, decodes, bytes that reached the disk
    for epoch, ((b0, d0, r0), (b1, d1, r1)) in enumerate(itertools.pairwise(marks)):
        # every decode served every job that wanted its row (four jobs: not 4x the rows);
        # in the first epoch jobs opened a moment apart share less of their first batches
        most = (1.5 if epoch == 0 else 1.25) * union
        assert d1 - d0 <= most, (epoch, d1 - d0, union)
        assert b1 - b0 <= most / union * size, (epoch, b1 - b0, size)  # a batch a row
        if r0 is not None:  # the disk: the pages were gone, and each is read once
            assert 0.5 * size <= r1 - r0 <= 1.15 * size, (epoch, r1 - r0, size)
