"""Job options: one declared table, checked at REGISTER, stored typed."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

import catalog
from catalog import OptionError, StatementError
from catalog.options import (
    BATCH_BYTES_LIMIT,
    JOB_OPTIONS,
    check_open,
    check_options,
    option_value,
)


@pytest.fixture
def cat(tmp_path):
    with catalog.connect(tmp_path / "cat") as c:
        c.import_arrow("t", pa.table({"x": list(range(100))}))
        yield c


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("batch_size = -3", r"batch_size = -3 is out of range; .* from 1 to 65536, e\.g\. WITH"),
        ("batch_size = 0", r"batch_size = 0 is out of range; .*WITH \(batch_size = 32\)"),
        ("batch_size = 'abc'", r"batch_size = 'abc' is not an integer; rows per batch is a whole"),
        ("batch_size = 2.5", "batch_size = 2.5 is not an integer"),
        ("batch_size = TRUE", "batch_size = TRUE is not an integer"),
        ("image_size = 0", r"image_size = 0 is out of range; .*WITH \(image_size = 224\)"),
        ("image_size = -1", "image_size = -1 is out of range"),
        ("batchsize = 32", r"Unknown job option 'batchsize'\. Did you mean 'batch_size'\?"),
        ("lr = 0.1", r"Unknown job option 'lr'\. Job options: batch_size, image_size, seed"),
        ("on_error = 'ignore'", r"on_error = 'ignore' is not one of 'raise', 'skip'"),
        ("seed = -1", "seed = -1 is out of range"),
        (
            "image_size = 100000",
            r"image_size = 100000 is out of range; .* from 1 to 32768",
        ),
        (
            "image_size = 20000",
            r"image_size = 20000 makes one batch of 32 images 35\.8 GiB .*over the 4 GiB "
            r"limit for one batch; use image_size <= 6688 with batch_size = 32",
        ),
        (
            "batch_size = 4096, image_size = 1024",
            r"over the 4 GiB limit for one batch; use image_size <= 591 with batch_size = 4096",
        ),
    ],
)
def test_bad_options_are_refused_at_register(cat, options, message):
    with pytest.raises(OptionError, match=message) as info:
        cat.sql(f"REGISTER JOB j SELECT x FROM t WITH ({options})")
    assert isinstance(info.value, StatementError)
    assert "\n" not in str(info.value)
    assert cat.job_names() == []


def test_the_python_api_checks_options_too(cat):
    with pytest.raises(OptionError, match="Did you mean 'image_size'"):
        cat.register_job("j", "t", options={"imagesize": 64})
    job = cat.register_job("j", "t", options={"batch_size": 16})
    assert job.options == {"batch_size": 16}


def test_options_are_stored_typed(cat):
    cat.sql("REGISTER JOB j SELECT x FROM t WITH (batch_size = 16, image_size = 32, seed = 7)")
    stored = cat.connection.execute("SELECT options FROM _tabloader.jobs").fetchone()[0]
    assert json.loads(stored) == {"batch_size": 16, "image_size": 32, "seed": 7}
    assert all(type(v) is int for v in cat.job("j").options.values())


def test_the_loader_reads_defaults_from_the_table():
    assert option_value({}, "batch_size") == JOB_OPTIONS["batch_size"].default == 32
    assert option_value({}, "image_size") is None
    assert option_value({"on_error": "skip"}, "on_error") == "skip"
    with pytest.raises(OptionError, match="batch_size = 'abc'"):  # a job of an older tabloader
        option_value({"batch_size": "abc"}, "batch_size")


def test_a_batch_at_the_limit_is_accepted():
    side = 6688  # the largest side the message above offers for batch_size 32
    assert 32 * side * side * 3 <= BATCH_BYTES_LIMIT < 32 * (side + 1) ** 2 * 3
    assert check_options({"image_size": side}) == {"image_size": side}
    with pytest.raises(OptionError, match="image_size <= 6688"):
        check_options({"image_size": side + 1})


def test_open_cannot_ask_for_what_register_refuses():
    stored = check_options({"batch_size": 65536})
    assert check_open(stored, image_size=None) == {"batch_size": 65536}
    assert check_open(stored, batch_size=8, image_size=(20, 30)) == {
        "batch_size": 8,
        "image_size": (20, 30),
    }
    with pytest.raises(OptionError, match=r"open\(image_size=512\): .* 48\.0 GiB .* <= 147"):
        check_open(stored, image_size=512)
    with pytest.raises(OptionError, match=r"image_size = \(2000, 3000\) makes one batch"):
        check_open({}, batch_size=256, image_size=(2000, 3000))  # each side in range
    with pytest.raises(OptionError, match=r"open\(image_size=\(0, 5\)\): .* out of range"):
        check_open({}, image_size=(0, 5))
