"""Error paths shared by the importers (the format table, Arrow IPC and Parquet files)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tabloader.catalog._errors import ImportFailedError
from tabloader.catalog._importers import Source, detect_format, open_source


def write_ipc(path, table, *, stream=False, batch_rows=10):
    new = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as f, new(f, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return path


def corrupt_parquet(path):
    """A Parquet file whose footer reads but whose first page header does not."""
    pq.write_table(pa.table({"x": list(range(100))}), path)
    data = bytearray(path.read_bytes())
    data[4:20] = b"\xff" * 16
    path.write_bytes(bytes(data))
    return path


def truncated_stream(path):
    write_ipc(path, pa.table({"x": list(range(100))}), stream=True)
    path.write_bytes(path.read_bytes()[:-200])
    return path


def two_schemas(tmp_path, suffix, write):
    write(pa.table({"x": [1, 2]}), tmp_path / f"a{suffix}")
    write(pa.table({"y": ["z"]}), tmp_path / f"b{suffix}")
    return str(tmp_path / f"*{suffix}")


def open_bad_batch(_):
    schema = pa.schema([("x", pa.int64())])
    batch = pa.record_batch([pa.array(["not a number"])], names=["x"])
    return Source(schema, iter([batch]))


CASES = {
    "unknown format": (
        lambda p: open_source("csv", p),
        r"Unknown format 'csv'; use one of arrow, hf, imagefolder, parquet\.",
    ),
    "cannot tell": (
        lambda p: (p / "x.csv").write_text("a\n1") and open_source(detect_format(p / "x.csv"), p),
        r"Cannot tell the format of '.*x\.csv'; add FORMAT imagefolder\|parquet\|arrow\|hf\.",
    ),
    "arrow schemas": (
        lambda p: open_source("arrow", two_schemas(p, ".arrow", lambda t, f: write_ipc(f, t))),
        r"'.*b\.arrow' has schema y: string but '.*a\.arrow' has x: int64; import files with one "
        r"schema together\.",
    ),
    "parquet schemas": (
        lambda p: open_source("parquet", two_schemas(p, ".parquet", pq.write_table)),
        r"'.*b\.parquet' has schema y: string but .*; import files with one schema together\.",
    ),
    "batch schema": (
        open_bad_batch,
        r"A batch of the source has schema x: string, not x: int64: .*not a number",
    ),
    "parquet pages": (
        lambda p: open_source("parquet", corrupt_parquet(p / "bad.parquet")),
        r"Cannot read Parquet file '.*bad\.parquet': .*thrift",
    ),
    "arrow stream": (
        lambda p: open_source("arrow", truncated_stream(p / "t.arrows")),
        r"Cannot read '.*t\.arrows': .*\. Check the file\.",
    ),
}


@pytest.mark.parametrize(("open_", "message"), CASES.values(), ids=CASES.keys())
def test_import_errors_store_nothing(cat, tmp_path, open_, message):
    with pytest.raises(ImportFailedError, match=message):
        cat.import_source("d", open_(tmp_path))
    assert cat.dataset_names() == []
    assert list((cat.root / "data").iterdir()) == []
