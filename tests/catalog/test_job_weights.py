"""Job weights (issue 39): a ``weight`` expression checked, evaluated at REGISTER and kept."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pytest

from tabloader import catalog
from tabloader.catalog import OptionError, StorageError
from tabloader.catalog._bitmaps import bitmap_to_array
from tabloader.catalog._errors import ForbiddenExpressionError, UnknownColumnError
from tabloader.catalog._job_weights import weights_crc

N = 40
X = np.arange(N)
SOURCE = np.where(X % 3 == 0, "web", "book")
SCORE = np.where(X % 7 == 0, np.nan, X / 4)  # NaN where x % 7 == 0
GAP = [None if i % 5 == 0 else float(i) for i in range(N)]  # NULL where x % 5 == 0


def _table() -> pa.Table:
    return pa.table(
        {
            "x": X,
            "source": SOURCE,
            "score": SCORE,
            "gap": pa.array(GAP, pa.float64()),
            "image": [b"\x00"] * N,
        }
    )


@pytest.fixture
def cat(tmp_path):
    with catalog.open_catalog(tmp_path / "cat") as c:
        c.import_arrow("t", _table())
        yield c


@pytest.fixture(scope="module")
def refusing(tmp_path_factory):
    """One catalog for the statements that must leave it unchanged (each checks that)."""
    with catalog.open_catalog(tmp_path_factory.mktemp("refusing") / "cat") as c:
        c.import_arrow("t", _table())
        yield c


def _files(c) -> list[str]:
    return sorted(p.suffix for p in (c.root / "jobs").iterdir())


def test_the_weight_is_evaluated_per_row_in_id_order(cat):
    job = cat.sql(
        "REGISTER JOB j SELECT x FROM t WHERE x >= 10 AND x < 30 "
        "WITH (weight = 'CASE WHEN source = ''web'' THEN 0.3 ELSE x / 2 END')"
    )
    ids = bitmap_to_array(job.ids)
    expected = np.where(SOURCE[ids] == "web", 0.3, X[ids] / 2)
    assert job.weights.dtype == np.float64
    np.testing.assert_array_equal(job.weights, expected)
    stored = cat.job("j")
    np.testing.assert_array_equal(stored.weights, expected)
    assert stored.options == {"weight": "CASE WHEN source = 'web' THEN 0.3 ELSE x / 2 END"}
    assert _files(cat) == [".roaring", ".weights"]
    row = cat.connection.execute("SELECT weights_crc32 FROM _tabloader.jobs").fetchone()
    assert row[0] == weights_crc(expected)
    shown = cat.sql("SHOW JOBS").to_pylist()[0]["options"]
    assert shown == "weight=CASE WHEN source = 'web' THEN 0.3 ELSE x / 2 END"


def test_a_boolean_or_integer_weight_is_cast_to_float64(cat):
    job = cat.register_job("j", "t", options={"weight": "x % 2 = 0"})
    np.testing.assert_array_equal(job.weights, (X % 2 == 0).astype(np.float64))
    plain = cat.register_job("plain", "t")
    assert plain.weights is None
    assert cat.job("plain").weights is None


@pytest.mark.parametrize(
    ("weight", "error", "message"),
    [
        ("(SELECT 1)", ForbiddenExpressionError, r"Subqueries are not allowed in a job's weight"),
        (
            "length(image)",
            ForbiddenExpressionError,
            r"Column 'image' holds binary payload, .* cannot be used in a job's weight\. Use x, "
            r"source, score, gap instead",
        ),
        ("getenv('HOME')", ForbiddenExpressionError, r"getenv\(\) is not allowed in a job's w"),
        ("sorce = 'web'", UnknownColumnError, r"Unknown column 'sorce' .*Did you mean 'source'"),
        ("source", OptionError, r"The weight of job 'j' failed in DuckDB: .*map text to numbers"),
    ],
)
def test_the_allow_list_and_duckdb_refuse_a_bad_expression(refusing, weight, error, message):
    with pytest.raises(error, match=message) as info:
        refusing.register_job("j", "t", options={"weight": weight})
    assert "\n" not in str(info.value)
    assert refusing.job_names() == []
    assert _files(refusing) == []


@pytest.mark.parametrize(
    ("where", "weight", "message"),
    [
        (
            None,
            "x - 3",
            r"^Job 'j': weight x - 3 is negative for 3 of its 40 rows \(_id 0 \(-3\.0\), "
            r"1 \(-2\.0\), 2 \(-1\.0\)\); a weight must be >= 0: write greatest\(x - 3, 0\)",
        ),
        (
            None,
            "gap",
            r"^Job 'j': weight gap is NULL for 8 of its 40 rows \(_id 0 \(NULL\), 5 \(NULL\), "
            r"10 \(NULL\), 15 \(NULL\), 20 \(NULL\) and 3 more\); .*write COALESCE\(gap, 0\)",
        ),
        (
            "x > 0",
            "score",
            r"^Job 'j': weight score is NaN or infinite for 5 of its 39 rows \(_id 7 \(nan\), "
            r"14 \(nan\), 21 \(nan\), 28 \(nan\), 35 \(nan\)\); a weight must be finite",
        ),
        (
            None,
            "1 / (x - 4.0) * 0 + CASE WHEN x = 4 THEN 1e400 ELSE 1 END",
            r"is NaN or infinite for 1 of its 40 rows \(_id 4 \(",
        ),
        (
            "x < 8",
            "x * 0",
            r"^Job 'j': weight x \* 0 is 0 for all 8 rows \(_id 0, 1, 2, 3, 4, \.\.\.\), so no "
            r"row could be drawn; give some rows a positive weight\.$",
        ),
    ],
)
def test_bad_weights_are_refused_naming_rows_and_nothing_is_stored(
    refusing, where, weight, message
):
    with pytest.raises(OptionError, match=message) as info:
        refusing.register_job("j", "t", where=where, options={"weight": weight})
    assert "\n" not in str(info.value)
    assert refusing.job_names() == []
    assert _files(refusing) == []


def test_a_failed_replace_keeps_the_old_job_and_its_weights(cat):
    cat.register_job("j", "t", options={"weight": "x + 1"})
    with pytest.raises(OptionError, match="is negative"):
        cat.register_job("j", "t", options={"weight": "x - 1"}, replace=True)
    np.testing.assert_array_equal(cat.job("j").weights, X + 1.0)
    assert _files(cat) == [".roaring", ".weights"]
    cat.register_job("j", "t", options={"weight": "x + 2"}, replace=True)  # the old files go
    np.testing.assert_array_equal(cat.job("j").weights, X + 2.0)
    assert _files(cat) == [".roaring", ".weights"]
    cat.register_job("j", "t", replace=True)  # no weights any more
    assert cat.job("j").weights is None
    assert _files(cat) == [".roaring"]


def test_weights_survive_reopening_and_a_lost_or_torn_file_is_rebuilt(tmp_path, caplog):
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as c:
        c.import_arrow("t", _table())
        c.register_job(
            "j", "t", where="x % 2 = 1 AND NOT isnan(score)", options={"weight": "score + 1"}
        )
    rows = X[(X % 2 == 1) & (X % 7 != 0)]
    want = rows / 4 + 1
    (file,) = (root / "jobs").glob("*.weights")
    with catalog.open_catalog(root) as c:  # reopened: read from the file
        np.testing.assert_array_equal(c.job("j").weights, want)
        file.unlink()
        with caplog.at_level(logging.WARNING, logger="tabloader.catalog._job_weights"):
            np.testing.assert_array_equal(c.job("j").weights, want)  # rebuilt
        assert "rebuilding its weights" in caplog.text
        assert file.exists()
        file.write_bytes(file.read_bytes()[:-8])  # torn
        np.testing.assert_array_equal(c.job("j").weights, want)
        assert len(file.read_bytes()) == 8 * want.size
        blob = bytearray(file.read_bytes())
        blob[0] ^= 1  # same size, other bytes: the CRC tells
        file.write_bytes(bytes(blob))
        np.testing.assert_array_equal(c.job("j").weights, want)


def test_weights_that_cannot_be_rebuilt_raise_naming_the_fix(cat):
    cat.register_job("j", "t", options={"weight": "x + 1"})
    cat.connection.execute("UPDATE _tabloader.jobs SET weights_crc32 = weights_crc32 + 1")
    with pytest.raises(StorageError, match=r"The weights of job 'j' are lost: .* REGISTER OR RE"):
        cat.job("j")


def test_an_append_keeps_the_job_pinned_and_a_replace_repins_it(cat):
    cat.register_job("j", "t", options={"weight": "x + 1"})
    more = _table().set_column(0, "x", pa.array(X + N))
    cat.import_arrow("t", more, append=True)
    for f in (cat.root / "jobs").glob("*.weights"):
        f.unlink()
    job = cat.job("j")  # rebuilt at version 1: the appended rows are not the job's
    np.testing.assert_array_equal(job.weights, X + 1.0)
    job = cat.register_job("j", "t", options={"weight": "x + 1"}, replace=True)
    assert job.dataset_version == 2
    np.testing.assert_array_equal(job.weights, np.arange(2 * N) + 1.0)


def test_unregister_drop_and_cleanup_remove_weights_files(tmp_path):
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as c:
        c.import_arrow("t", _table())
        c.register_job("a", "t", options={"weight": "x + 1"})
        c.register_job("b", "t", options={"weight": "x + 1"})
        c.unregister_job("a")
        assert _files(c) == [".roaring", ".weights"]
        (root / "jobs" / "a-0123456789ab.weights").write_bytes(b"left over")
        (root / "jobs" / "notes.weights").write_bytes(b"not ours")
    with catalog.open_catalog(root) as c:  # the leftover of a crash goes, the rest stays
        names = sorted(p.name for p in (root / "jobs").iterdir())
        assert "a-0123456789ab.weights" not in names
        assert "notes.weights" in names
        np.testing.assert_array_equal(c.job("b").weights, X + 1.0)
        c.drop_dataset("t", cascade=True)
        assert sorted(p.name for p in (root / "jobs").iterdir()) == ["notes.weights"]


def test_a_catalog_without_the_weights_column_is_upgraded(tmp_path):
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as c:
        c.import_arrow("t", _table())
        c.register_job("j", "t", where="x < 5")
        c.connection.execute("ALTER TABLE _tabloader.jobs DROP COLUMN weights_crc32")
    with catalog.open_catalog(root) as c:
        assert c.job("j").weights is None
        job = c.register_job("w", "t", options={"weight": "x"}, where="x > 0")
        np.testing.assert_array_equal(c.job("w").weights, job.weights)


def test_an_older_catalog_opened_read_only_reads_its_jobs_without_weights(tmp_path, monkeypatch):
    root = tmp_path / "cat"
    with catalog.open_catalog(root, create=True) as c:
        c.import_arrow("t", _table())
        c.register_job("j", "t", where="x < 5")
        c.connection.execute("ALTER TABLE _tabloader.jobs DROP COLUMN weights_crc32")
    monkeypatch.setattr("tabloader.catalog._catalog.not_writable", lambda *_: "a test says so")
    with catalog.open_catalog(root) as c:
        assert c.job("j").weights is None
        assert c.job("j").num_rows == 5
        with pytest.raises(catalog.CatalogError, match="is read-only: a test says so"):
            c.register_job("w", "t", options={"weight": "x"})


def test_a_weighted_job_crosses_the_service_wire():
    from pyroaring import BitMap

    from tabloader.catalog._model import Job
    from tabloader.service._protocol import job_from_wire, job_to_wire

    weights = np.array([0.5, 1e-300, 3.0])
    job = Job("j", "t", 1, ("x",), None, {"weight": "x"}, BitMap([1, 4, 9]), weights)
    back = job_from_wire(json.loads(json.dumps(job_to_wire(job))))
    assert back == job
    assert back.ids == job.ids
    np.testing.assert_array_equal(back.weights, weights)
    plain = job_from_wire(json.loads(json.dumps(job_to_wire(Job(*job_fields(job))))))
    assert plain.weights is None


def job_fields(job):
    return job.name, job.dataset, job.dataset_version, job.columns, None, {}, job.ids


def test_the_weights_reach_the_engines_sampler(cat, monkeypatch):
    """An in-process loader hands the job's stored weights to its sampler: a job that weighs
    only ``x < 10`` draws only those rows with replacement, and them first without."""
    from tabloader.engine import Loader
    from tabloader.sampling._dependent import DependentSampler
    from tabloader.sampling._independent import IndependentSampler

    given: dict[str, np.ndarray | None] = {}
    for cls in (DependentSampler, IndependentSampler):
        add = cls.add_job

        def record(self, name, ids, spec=None, *, _add=add, **kw):
            given[name] = kw.get("weights")
            return _add(self, name, ids, spec, **kw)

        monkeypatch.setattr(cls, "add_job", record)
    first = "CASE WHEN x < 10 THEN 1 ELSE 0 END"
    cat.register_job("drawn", "t", columns="x", options={"weight": first, "batch_size": 8})
    cat.register_job("ordered", "t", columns="x", options={"weight": first, "replacement": False})
    cat.register_job("plain", "t", columns="x")
    epochs = {}
    with Loader(cat, cache_bytes=1 << 20) as loader:
        for name in ("drawn", "ordered", "plain"):
            with loader.open(name, epochs=1) as stream:
                epochs[name] = np.concatenate([np.asarray(b["_id"]) for b in stream])
    np.testing.assert_array_equal(given["drawn"], (X < 10).astype(np.float64))
    np.testing.assert_array_equal(given["ordered"], given["drawn"])
    assert given["plain"] is None
    drawn = epochs["drawn"]
    assert drawn.size == N
    assert set(drawn.tolist()) <= set(range(10))  # 40 draws of 10 rows: repeats
    assert sorted(epochs["ordered"].tolist()) == list(range(N))  # every row once
    assert set(epochs["ordered"][:10].tolist()) == set(range(10))  # the weighted rows first
    assert sorted(epochs["plain"].tolist()) == list(range(N))


def test_weights_whose_sum_overflows_are_drawn_as_declared(cat):
    """The rows under 10 weigh 1e308 and the others 1e307: their sum overflows float64. They
    were accepted, then every open failed with a raw IndexError (with replacement) or drew the
    job in uniform order (without); the sampler scales by the maximum before summing."""
    from tabloader.engine import Loader

    heavy = "CASE WHEN x < 10 THEN 1e308 ELSE 1e307 END"
    cat.register_job("drawn", "t", columns="x", options={"weight": heavy, "batch_size": 8})
    cat.register_job("ordered", "t", columns="x", options={"weight": heavy, "replacement": False})
    with np.errstate(over="ignore"):
        assert np.isinf(cat.job("drawn").weights.sum())
    with Loader(cat, cache_bytes=1 << 20) as loader:
        with loader.open("drawn", epochs=25) as stream:
            drawn = np.concatenate([np.asarray(b["_id"]) for b in stream])
        with loader.open("ordered", epochs=1) as stream:
            ordered = np.concatenate([np.asarray(b["_id"]) for b in stream])
    assert drawn.size == 25 * N
    # a row under 10 is drawn with probability 10 / 13 (uniform: 1 / 4)
    assert abs((drawn < 10).mean() - 10 / 13) < 0.05
    assert sorted(ordered.tolist()) == list(range(N))
    assert (ordered[:10] < 10).sum() >= 6  # 7.7 of 10 expected; uniform order: 2.5


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            "SET weights_crc32 = NULL",
            r"^Job 'j' is damaged: its row in the catalog has a weight \(x \+ 1\) and no CRC-32 "
            r"of its weights \(weights_crc32 is NULL\), so it can be drawn neither by its "
            r"weights nor uniformly\. Register the job again: REGISTER OR REPLACE JOB j",
        ),
        (
            "SET options = '{}'",
            r"^Job 'j' is damaged: its row in the catalog has a CRC-32 of weights "
            r"\(weights_crc32\) and no weight option, .* REGISTER OR REPLACE JOB j",
        ),
    ],
    ids=["weight-without-crc", "crc-without-weight"],
)
def test_a_weighted_job_without_its_crc_is_damaged_not_uniform(cat, edit, message):
    from tabloader.engine import Loader

    cat.register_job("j", "t", columns="x", options={"weight": "x + 1"})
    cat.connection.execute(f"UPDATE _tabloader.jobs {edit}")
    with pytest.raises(StorageError, match=message):
        cat.job("j")
    with Loader(cat, cache_bytes=1 << 20) as loader, pytest.raises(StorageError, match=message):
        loader.open("j")


@pytest.mark.parametrize(
    ("column", "stored", "suffix", "message"),
    [
        (
            "options",
            json.dumps({"weight": "(SELECT 1) * (x + 1)"}),
            ".weights",
            r"The weights of job 'j' are lost: .* its weight fails at version 1: Subqueries are "
            r"not allowed in a job's weight\..* REGISTER OR REPLACE JOB j",
        ),
        (
            "predicate",
            "x < 30 AND (SELECT true)",
            ".roaring",
            r"The row ids of job 'j' are lost: .* its predicate fails at version 1: Subqueries "
            r"are not allowed in a job predicate\..* REGISTER OR REPLACE JOB j",
        ),
    ],
    ids=["weight", "predicate"],
)
def test_a_hand_edited_expression_is_checked_again_before_it_runs(
    cat, column, stored, suffix, message
):
    """Edited to a text the allow-list refuses that gives the same values (so the CRC would
    pass), a stored weight or predicate was evaluated again as it was when its file was lost."""
    cat.register_job("j", "t", where="x < 30", options={"weight": "x + 1"})
    cat.connection.execute(f"UPDATE _tabloader.jobs SET {column} = ?", [stored])
    for f in (cat.root / "jobs").glob(f"*{suffix}"):
        f.unlink()
    with pytest.raises(StorageError, match=message):
        cat.job("j")
