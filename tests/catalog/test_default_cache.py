"""REGISTER says when a loader service with the default cache could not serve the job: its
real batch (the smaller of batch_size and its rows) held 3 times over the cache."""

from __future__ import annotations

import warnings

import pyarrow as pa
import pytest

from tabloader import catalog
from tabloader.catalog._options import default_cache_problem


@pytest.fixture
def cat(tmp_path):
    with catalog.open_catalog(tmp_path / "cat", create=True) as c:
        c.import_arrow("t", pa.table({"image": [b"x"] * 600, "label": [i % 3 for i in range(600)]}))
        yield c


def test_register_warns_when_a_default_service_could_not_serve_the_job(cat, monkeypatch):
    monkeypatch.delenv("TABLOADER_CACHE_BYTES", raising=False)
    with pytest.warns(UserWarning, match="a service started by default") as record:
        cat.sql("REGISTER JOB big SELECT image FROM t WITH (batch_size = 512, image_size = 512)")
    [warning] = record
    assert str(warning.message) == (
        "Job 'big': a batch of 512 rows takes 384.0 MiB of decoded images and a loader service "
        "holds 3 at once, more than the default cache of 1.0 GiB: a service started by default "
        "could not open the job. Start it with --cache-bytes 1152MiB or more (or set "
        "$TABLOADER_CACHE_BYTES), or lower batch_size or the image size."
    )
    assert cat.job("big").num_rows == 600  # registered all the same (a larger cache serves it)


def test_register_counts_the_real_batch_not_batch_size(cat, monkeypatch):
    """65536 x 147x147 images would be 4 GiB, but the job has 200 rows: 13 MB a batch."""
    monkeypatch.delenv("TABLOADER_CACHE_BYTES", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cat.sql(
            "REGISTER JOB small SELECT image FROM t WHERE label = 0 "
            "WITH (batch_size = 65536, image_size = 147)"
        )
    monkeypatch.setenv("TABLOADER_CACHE_BYTES", str(32 << 20))  # 3 x 13 MB do not fit
    with pytest.warns(UserWarning, match=r"a batch of 200 rows takes 12\.4 MiB .* of 32\.0 MiB"):
        cat.sql(
            "REGISTER OR REPLACE JOB small SELECT image FROM t WHERE label = 0 "
            "WITH (batch_size = 65536, image_size = 147)"
        )


@pytest.mark.parametrize(
    ("options", "rows", "warns"),
    [
        ({"batch_size": 64, "image_size": 2048}, 1000, True),
        ({"batch_size": 64, "image_size": 2048}, 10, False),
        ({"batch_size": 64, "augment": "RandomResizedCrop(2048)"}, 1000, True),
        ({"batch_size": 64}, 10**6, False),  # images at their own size: nothing to estimate
    ],
)
def test_default_cache_problem(options, rows, warns, monkeypatch):
    monkeypatch.delenv("TABLOADER_CACHE_BYTES", raising=False)
    assert (default_cache_problem("j", options, rows) is not None) == warns
    monkeypatch.setenv("TABLOADER_CACHE_BYTES", "lots")  # malformed: the service says so
    assert default_cache_problem("j", options, rows) is None
