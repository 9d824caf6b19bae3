"""numpy and Python values to Arrow without pyarrow's pandas shim (tabloader.catalog._arrays)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from tabloader.catalog._arrays import empty_table, from_values


@pytest.mark.parametrize(
    ("values", "t"),
    [
        ([1, None, -3, 2**62], pa.int64()),
        ([1.5, None, 2, -0.0], pa.float64()),
        ([True, None, False, True] * 3, pa.bool_()),  # over a byte of bits
        (["a", None, "héllo", ""], pa.string()),
        ([b"\x00x", None, b""], pa.binary()),
        ([], pa.string()),
        ([None, None], pa.int64()),
        ([1, 2], pa.int32()),  # through pyarrow: not a type of the buffers' path
        (["a"], pa.large_string()),
    ],
)
def test_from_values_equals_pyarrows_own_conversion(values, t):
    got = from_values(values, t)
    got.validate(full=True)
    assert got.equals(pa.array(values, t))


@pytest.mark.parametrize(
    ("values", "t", "error", "message"),
    [
        (["a"], pa.int64(), pa.ArrowInvalid, "Could not convert 'a'"),
        ([1], pa.string(), pa.ArrowTypeError, "Expected bytes, got a 'int'"),
        (["x"], pa.binary(), None, None),  # pyarrow takes a str as binary: so do we
    ],
)
def test_values_of_another_kind_get_pyarrows_own_answer(values, t, error, message):
    if error is None:
        assert from_values(values, t).equals(pa.array(values, t))
        return
    with pytest.raises(error, match=message):
        from_values(values, t)


def test_empty_table_is_the_schemas_own():
    schema = pa.schema(
        [("_id", pa.int64()), ("image", pa.binary()), ("tags", pa.list_(pa.string()))]
    )
    got = empty_table(schema)
    assert got.equals(schema.empty_table())
    assert got.schema == schema
    assert [c.num_chunks for c in got.columns] == [1, 1, 1]  # as pyarrow's: a chunk a column


def test_an_import_and_listing_statements_never_wake_pyarrows_pandas_shim(tmp_path, image_folder):
    """A fresh ``tabloader import`` of an image folder, a REGISTER and the SHOW statements run
    without importing pandas: ``SHOW JOBS`` took 0.72 s in a fresh interpreter, 0.27 of them
    importing it (pyarrow imports it at its first conversion of Python values)."""
    script = textwrap.dedent(f"""
        import sys
        from tabloader.cli import main
        root = {str(tmp_path / "cat")!r}
        assert main(["--catalog", root, "import", "imgs", {str(image_folder)!r}]) == 0
        for statement in (
            "REGISTER JOB j SELECT image, label FROM imgs WHERE label < 2",
            "SHOW JOBS",
            "SHOW DATASETS",
            "DESCRIBE imgs",
        ):
            assert main(["--catalog", root, "sql", statement]) == 0
        print("pandas" in sys.modules, file=sys.stderr)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "False"
    assert "j     imgs" in proc.stdout  # the listing, as before
