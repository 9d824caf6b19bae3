"""A stored image whose bytes changed after import: the loader raises, or skips and counts.

Flipping one byte inside a JPEG's compressed data still decodes (to wrong pixels): without
checksums such rows trained normally. Each reader (the loader's threads, and each decode
process with its own reader) checks a record batch on its first read.
"""

from __future__ import annotations

import pytest

from tabloader import catalog
from tabloader.catalog._errors import StorageError
from tabloader.engine import Loader
from tabloader.engine._arena.shm import shm_available
from tabloader.engine.decode import decode_image


@pytest.fixture
def damaged(image_cat_dir):
    """A catalog of the image folder with one byte flipped inside one stored JPEG; yields
    (catalog, the damaged rows, the file)."""
    with catalog.open_catalog(image_cat_dir) as cat:
        ds = cat.dataset("imgs")
        [path] = ds.files
        part = ds.reader.parts[0]
        victim = part.rows_per_batch + 1  # the second record batch
        jpeg = ds.take([victim], ["image"]).column("image")[0].as_py()
    data = bytearray(path.read_bytes())
    at = data.find(jpeg) + len(jpeg) // 2  # inside the entropy-coded data
    data[at] ^= 0x04
    path.write_bytes(bytes(data))
    damaged_jpeg = bytes(data[at - len(jpeg) // 2 : at - len(jpeg) // 2 + len(jpeg)])
    assert decode_image(damaged_jpeg, size=16).shape == (16, 16, 3)  # decodes all the same
    rows = range(part.rows_per_batch, min(2 * part.rows_per_batch, part.num_rows))
    with catalog.open_catalog(image_cat_dir) as cat:
        cat.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (image_size = 16)")
        yield cat, rows, path


@pytest.mark.parametrize(
    "decode",
    [
        "threads",
        pytest.param(
            "processes",
            marks=pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system"),
        ),
    ],
)
def test_damaged_rows_raise_or_are_skipped_and_counted(damaged, decode):
    cat, rows, path = damaged
    n = cat.job("j").num_rows
    with Loader(cat, cache_bytes=16 << 20, workers=2, decode=decode) as loader:
        assert (loader.decode_pool is not None) == (decode == "processes")
        strict = loader.open("j", batch_size=n, epochs=1)
        with pytest.raises(StorageError) as info:
            strict.next_batch()
        assert info.value.dataset == "imgs"
        assert info.value.rows == rows
        assert info.value.path == str(path)
        assert f"dataset 'imgs', rows {rows.start}..{rows.stop - 1}, column 'image'" in str(
            info.value
        )
        strict.close()
    with Loader(cat, cache_bytes=16 << 20, workers=2, decode=decode) as loader:
        lenient = loader.open("j", batch_size=8, epochs=1, on_error="skip")
        got = [i for batch in lenient for i in batch["_id"].tolist()]
        assert sorted(got) == [i for i in range(n) if i not in rows]
        assert lenient.stats()["skipped"] == len(rows)
