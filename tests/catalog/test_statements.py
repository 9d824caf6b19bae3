from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyroaring import BitMap

from tabloader import catalog
from tabloader.catalog import (
    AlreadyExistsError,
    CatalogError,
    DatasetInUseError,
    ForbiddenExpressionError,
    ImportFailedError,
    JobNotFoundError,
    StatementError,
    StorageError,
    UnknownColumnError,
)


@pytest.fixture(scope="module")
def imagenet_table():
    n = 2000
    rng = np.random.default_rng(3)
    return pa.table(
        {
            "label": rng.integers(0, 1000, n),
            "split": np.where(rng.random(n) < 0.9, "train", "val"),
            "width": rng.integers(200, 800, n).astype(np.int32),
            "image": [rng.bytes(64) for _ in range(n)],
        }
    )


@pytest.fixture(scope="module")
def imagenet_catalog(tmp_path_factory, imagenet_table):
    """A catalog holding ``imagenet_table`` as dataset ``imagenet``, imported once (closed)."""
    root = tmp_path_factory.mktemp("imagenet") / "cat"
    with catalog.open_catalog(root, create=True) as cat:
        cat.import_arrow("imagenet", imagenet_table)
    return root


@pytest.fixture
def cat(request, tmp_path):
    """The suite's ``cat``; with ``imagenet`` it holds that dataset already (a copy of one
    import per module: 66 tests take it)."""
    wanted = "imagenet_catalog" if "imagenet" in request.fixturenames else "empty_catalog"
    root = tmp_path / "cat"  # copied as conftest's ``cat`` copies ``empty_catalog``
    shutil.copytree(request.getfixturevalue(wanted), root, copy_function=shutil.copy)
    with catalog.open_catalog(root, create=True) as c:
        yield c


@pytest.fixture
def imagenet(cat, imagenet_table):
    """Dataset ``imagenet`` of ``cat`` (imported by ``cat`` itself, see there): its table."""
    return imagenet_table


def expected_ids(cat, where: str) -> BitMap:
    rows = cat.connection.execute(f"SELECT _id FROM imagenet WHERE {where}").fetchall()
    return BitMap(r[0] for r in rows)


def test_register_job_builds_the_bitmap(cat, imagenet):
    job = cat.sql(
        "REGISTER JOB resnet18 SELECT image, label FROM imagenet "
        "WHERE label < 500 AND split = 'train' WITH (batch_size = 256, seed = 7)"
    )
    assert job.ids == expected_ids(cat, "label < 500 AND split = 'train'")
    assert job.columns == ("image", "label")
    assert job.predicate == "label < 500 AND split = 'train'"
    assert job.options == {"batch_size": 256, "seed": 7}
    assert job.dataset_version == 1
    assert cat.job("resnet18") == job
    assert cat.job("resnet18").ids == job.ids


def test_register_star_and_no_where(cat, imagenet):
    job = cat.sql("register job all_rows select * from imagenet")
    assert job.columns == ("label", "split", "width", "image")
    assert job.ids == BitMap(range(2000))
    assert job.predicate is None


def test_options_types(cat, imagenet):
    job = cat.sql(
        "REGISTER JOB j SELECT label FROM imagenet WITH (Batch_Size = 8, on_error = 'SKIP', "
        "image_size = 64, seed = 0)"
    )
    assert job.options == {"batch_size": 8, "on_error": "skip", "image_size": 64, "seed": 0}
    assert cat.job("j").options == job.options


def test_register_is_pinned_to_version_until_reregistered(cat, imagenet):
    cat.sql("REGISTER JOB j SELECT label FROM imagenet WHERE label < 100")
    before = cat.job("j")
    cat.import_arrow("imagenet", imagenet, append=True)
    assert cat.dataset("imagenet").version == 2
    after = cat.job("j")
    assert after.dataset_version == 1
    assert after.ids == before.ids
    with pytest.raises(AlreadyExistsError, match="REGISTER OR REPLACE JOB j"):
        cat.sql("REGISTER JOB j SELECT label FROM imagenet WHERE label < 100")
    again = cat.sql("REGISTER OR REPLACE JOB j SELECT label FROM imagenet WHERE label < 100")
    assert again.dataset_version == 2
    assert len(again.ids) == 2 * len(before.ids)
    assert again.ids == expected_ids(cat, "label < 100")


def test_show_describe_unregister_drop(cat, imagenet):
    cat.sql("REGISTER JOB a SELECT label FROM imagenet WHERE label < 10")
    cat.sql("REGISTER JOB b SELECT image FROM imagenet WHERE split = 'val'")
    datasets = cat.sql("SHOW DATASETS").to_pylist()
    assert [(d["name"], d["rows"], d["jobs"]) for d in datasets] == [("imagenet", 2000, 2)]
    jobs = cat.sql("SHOW JOBS").to_pylist()
    assert [(j["name"], j["rows"]) for j in jobs] == [
        ("a", len(expected_ids(cat, "label < 10"))),
        ("b", len(expected_ids(cat, "split = 'val'"))),
    ]
    desc = cat.sql("DESCRIBE imagenet").to_pylist()
    assert [(d["column"], d["queryable"]) for d in desc] == [
        ("_id", True),
        ("label", True),
        ("split", True),
        ("width", True),
        ("image", False),
    ]
    assert cat.sql("UNREGISTER JOB a") is None
    assert cat.job_names() == ["b"]
    assert cat.sql("UNREGISTER JOB IF EXISTS a") is None
    with pytest.raises(JobNotFoundError, match="Unknown job 'a'"):
        cat.sql("UNREGISTER JOB a")
    with pytest.raises(
        DatasetInUseError,
        match="used by job.* b; UNREGISTER JOB them first, or DROP DATASET imagenet CASCADE",
    ):
        cat.sql("DROP DATASET imagenet")
    assert cat.dataset_names() == ["imagenet"]
    cat.sql("DROP DATASET imagenet CASCADE")
    assert cat.dataset_names() == []
    assert cat.job_names() == []
    assert list((cat.root / "data").iterdir()) == []
    assert cat.sql("DROP DATASET IF EXISTS imagenet") is None


def test_select_passthrough(cat, imagenet):
    out = cat.sql("SELECT split, count(*) AS n FROM imagenet GROUP BY split ORDER BY split")
    assert isinstance(out, pa.Table)
    assert out.column("split").to_pylist() == ["train", "val"]
    assert sum(out.column("n").to_pylist()) == 2000


def test_create_dataset_statement_formats(cat, tmp_path, image_folder):
    table = pa.table({"x": list(range(10))})
    pq.write_table(table, tmp_path / "t.parquet")
    ds = cat.sql(f"CREATE DATASET p FROM '{tmp_path / 't.parquet'}'")
    assert ds.num_rows == 10
    ds = cat.sql(f"CREATE DATASET p2 FROM '{tmp_path / 't.parquet'}' FORMAT parquet")
    assert ds.num_rows == 10
    ds = cat.sql(f"CREATE DATASET imgs FROM '{image_folder}'")
    assert ds.columns == ["_id", "image", "label", "label_name", "path"]
    appended = cat.sql(f"APPEND TO DATASET p FROM '{tmp_path / 't.parquet'}'")
    assert (appended.version, appended.num_rows) == (2, 20)


@pytest.mark.parametrize(
    ("statement", "sent"),
    [
        ("CREATE DATASET d FROM 'imgs'", "CREATE DATASET d FROM '/work/imgs'"),
        (
            "append to dataset d from /* here */ './a''b\\c' format parquet",
            "append to dataset d from /* here */ '/work/a''b\\c' format parquet",
        ),
        ("CREATE DATASET d FROM $$x/*.arrow$$", "CREATE DATASET d FROM '/work/x/*.arrow'"),
        ("CREATE DATASET d FROM '/data/imgs'", "CREATE DATASET d FROM '/data/imgs'"),
        ("SELECT 'imgs' AS p", "SELECT 'imgs' AS p"),
    ],
)
def test_absolute_paths_rewrite_only_a_relative_from_path(statement, sent):
    """What a client sends the loader service: the path means one in the client's directory."""
    from tabloader.catalog._sql.dialect import absolute_paths, parse

    assert absolute_paths(statement, "/work") == sent
    if sent != statement:
        assert parse(sent).args["path"].name.startswith("/work/")


def test_absolute_paths_of_a_statement_that_does_not_parse():
    from tabloader.catalog._sql.dialect import absolute_paths

    with pytest.raises(StatementError, match="Expected a quoted path after FROM"):
        absolute_paths("CREATE DATASET d FROM imgs")


@pytest.mark.parametrize(
    ("statement", "error", "message"),
    [
        ("", StatementError, "Empty statement"),
        ("SHOW DATASETS; SHOW JOBS", StatementError, "exactly one statement, found 2"),
        ("REGISTER JOB x", StatementError, r"Expected SELECT .* \(line 1, col 14\)"),
        ("REGISTER JOB x SELECT FROM", StatementError, "Cannot parse statement"),
        ("SELECT a FROM imagenet WHERE (", StatementError, r"\(line 1, col 30\)"),
        (
            "REGISTER JOB x SELECT labl FROM imagenet",
            UnknownColumnError,
            r"Unknown column 'labl' in dataset 'imagenet'. Did you mean 'label'\? .* "
            r"\(line 1, col 23\)",
        ),
        (
            "REGISTER JOB x\nSELECT label,\n       imgae FROM imagenet",
            UnknownColumnError,
            r"Unknown column 'imgae' .* \(line 3, col 8\)",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE labl < 3",
            UnknownColumnError,
            r"Unknown column 'labl' in dataset 'imagenet'. Did you mean 'label'\? "
            r"\(line 1, col 49\)",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE label IN (SELECT 1)",
            ForbiddenExpressionError,
            "Subqueries are not allowed",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE getenv('HOME') = 'x'",
            ForbiddenExpressionError,
            r"Function getenv\(\) is not allowed",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE length(read_text('/etc/passwd')) > 0",
            ForbiddenExpressionError,
            "not allowed in a job predicate",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE image = 'a'",
            ForbiddenExpressionError,
            "holds binary payload",
        ),
        (
            "REGISTER JOB x SELECT label + 1 FROM imagenet",
            ForbiddenExpressionError,
            "Projections must be plain columns or",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet ORDER BY label",
            ForbiddenExpressionError,
            "remove ORDER",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet LIMIT 3",
            ForbiddenExpressionError,
            "remove LIMIT",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet JOIN imagenet AS b ON true",
            ForbiddenExpressionError,
            r"remove JOIN\. \(line 1, col 23\)",
        ),
        (
            "REGISTER JOB x SELECT DISTINCT label FROM imagenet",
            ForbiddenExpressionError,
            r"remove DISTINCT\.",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet GROUP BY label",
            ForbiddenExpressionError,
            r"remove GROUP\.",
        ),
        ("REGISTER JOB x SELECT label", StatementError, "REGISTER JOB needs FROM <dataset>"),
        (
            "REGISTER JOB x SELECT label FROM (SELECT 1)",
            StatementError,
            "REGISTER JOB needs FROM <dataset>",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet UNION SELECT label FROM imagenet",
            StatementError,
            r"REGISTER JOB takes one SELECT columns FROM dataset \[WHERE \.\.\.\]",
        ),
        (
            "REGISTER JOB x SELECT other.label FROM imagenet",
            StatementError,
            "Column 'other.label' does not belong to 'imagenet'",
        ),
        (
            "REGISTER JOB x SELECT *, label FROM imagenet",
            StatementError,
            "Use either \\* or a list of columns, not both",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE other.label < 3",
            UnknownColumnError,
            "refers to 'other', but the job reads 'imagenet'; drop the qualifier",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WITH (a)",
            StatementError,
            r"Expected key = value in WITH \(\.\.\.\), near '\)' \(line 1, col 50\)",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WITH (a = )",
            StatementError,
            r"Expected a value \(number, 'string', TRUE or FALSE\)",
        ),
        (
            "REGISTER JOB _x SELECT label FROM imagenet",
            CatalogError,
            "Invalid job name '_x': use a letter followed by",
        ),
        ("UNREGISTER JOB", StatementError, "Expected a job name"),
        (
            "SELECT label INTO t FROM imagenet",
            StatementError,
            r"SELECT \.\.\. INTO is not allowed; SELECT is read-only",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE label > 5000",
            StatementError,
            "would have no rows",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WHERE label = 'abc'",
            StatementError,
            "failed in DuckDB",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WITH (a = label)",
            StatementError,
            "Option 'a' must be a number",
        ),
        (
            "REGISTER JOB x SELECT label FROM imagenet WITH (a = 1, a = 2)",
            StatementError,
            "given twice",
        ),
        ("REGISTER JOB x SELECT label FROM imagnet", LookupError, "Did you mean 'imagenet'"),
        (
            "SELECT * FROM read_csv('/etc/passwd')",
            ForbiddenExpressionError,
            "Table functions are not allowed",
        ),
        ("SELECT getenv('HOME')", ForbiddenExpressionError, "not allowed"),
        *(
            (statement, ForbiddenExpressionError, f"Statements starting with '{first}' are not")
            for statement, first in [
                ("COPY imagenet TO '/tmp/x.csv'", "COPY"),
                ("ATTACH '/tmp/x.db' AS x", "ATTACH"),
                ("INSTALL httpfs", "INSTALL"),
                ("LOAD httpfs", "LOAD"),
                ("CALL pragma_version()", "CALL"),
                ("PRAGMA version", "PRAGMA"),
                ("SET threads = 1", "SET"),
                ("DELETE FROM imagenet", "DELETE"),
                ("DROP TABLE imagenet", "DROP"),
                ("CHECKPOINT", "CHECKPOINT"),  # sqlglot parses it as a column
                ("@@@", "@"),  # ... and this as ABS
                ("-- note\n  vacuum", "vacuum"),
            ]
        ),
        ("SELECT nope FROM imagenet", StatementError, "SELECT failed in DuckDB: Binder Error"),
        (
            "CREATE DATASET x FROM 'nowhere/at/all'",
            ImportFailedError,
            r"No such file or directory: 'nowhere/at/all'\. Check the path\.",
        ),
        ("CREATE DATASET x FROM 'a' FORMAT csv", StatementError, "Expected a FORMAT among"),
        ("CREATE DATASET x FROM a", StatementError, "Expected a quoted path"),
    ],
)
def test_statement_errors_leave_catalog_unchanged(cat, imagenet, statement, error, message):
    before = (
        cat.dataset_names(),
        cat.job_names(),
        cat.connection.execute("SELECT count(*) FROM imagenet").fetchone(),
    )
    with pytest.raises(error, match=message):
        cat.sql(statement)
    after = (
        cat.dataset_names(),
        cat.job_names(),
        cat.connection.execute("SELECT count(*) FROM imagenet").fetchone(),
    )
    assert after == before


@pytest.mark.parametrize("statement", ["LOAD httpfs", "CALL pragma_version()", "CHECKPOINT"])
def test_refused_statement_lists_the_allowed_ones_and_logs_nothing(cat, caplog, statement):
    with pytest.raises(ForbiddenExpressionError) as info:
        cat.sql(statement)
    assert str(info.value).endswith(
        "tabloader runs CREATE DATASET, APPEND TO DATASET, REGISTER JOB, UNREGISTER JOB, "
        "SHOW DATASETS, SHOW JOBS, DESCRIBE, DROP DATASET and read-only SELECT."
    )
    assert caplog.records == []  # sqlglot's "Falling back to parsing as a 'Command'"


def test_register_job_python_api(cat, imagenet):
    job = cat.register_job(
        "api", "imagenet", columns=["label"], where="width BETWEEN 300 AND 400", options={"seed": 1}
    )
    assert job.ids == expected_ids(cat, "width BETWEEN 300 AND 400")
    with pytest.raises(StatementError, match="Cannot parse"):
        cat.register_job("bad", "imagenet", where="width >")


def job_files(cat) -> list[str]:
    return sorted(p.name for p in (cat.root / "jobs").iterdir())


def test_job_files_follow_the_jobs(cat, imagenet):
    cat.sql("REGISTER JOB a SELECT label FROM imagenet WHERE label < 100")
    cat.sql("REGISTER JOB b SELECT label FROM imagenet")
    first = job_files(cat)
    assert [f.split("-")[0] for f in first] == ["a", "b"]
    cat.sql("REGISTER OR REPLACE JOB a SELECT label FROM imagenet WHERE label < 200")
    replaced = job_files(cat)
    assert len(replaced) == 2
    assert first[0] not in replaced
    assert first[1] in replaced
    assert cat.job("a").ids == expected_ids(cat, "label < 200")
    with pytest.raises(AlreadyExistsError, match="REGISTER OR REPLACE JOB a"):
        cat.sql("REGISTER JOB a SELECT label FROM imagenet WHERE label < 300")
    assert job_files(cat) == replaced  # the refused job's file is gone
    assert cat.job("a").ids == expected_ids(cat, "label < 200")
    cat.sql("UNREGISTER JOB a")
    assert [f.split("-")[0] for f in job_files(cat)] == ["b"]
    cat.sql("DROP DATASET imagenet CASCADE")
    assert job_files(cat) == []


def test_lost_job_bitmap_is_rebuilt_from_its_row(cat, imagenet):
    cat.sql("REGISTER JOB a SELECT label FROM imagenet WHERE label < 100")
    expected = expected_ids(cat, "label < 100")
    (path,) = (cat.root / "jobs").iterdir()
    cat.import_arrow("imagenet", imagenet, append=True)  # the rebuild must keep version 1
    for damage in (lambda: path.write_bytes(path.read_bytes()[:10]), path.unlink):
        damage()
        assert cat.job("a").ids == expected
        assert cat.job("a").dataset_version == 1
        assert BitMap.deserialize(path.read_bytes()) == expected  # the file is back
    # A rebuild that does not match the stored CRC is refused, not served.
    cat.connection.execute("UPDATE _tabloader.jobs SET crc32 = crc32 + 1")
    path.unlink()
    with pytest.raises(
        StorageError, match=r"row ids of job 'a' are lost: .* other rows .*REGISTER OR REPLACE"
    ):
        cat.job("a")


def test_leftover_job_files_are_removed_at_open(cat, imagenet):
    cat.sql("REGISTER JOB a SELECT label FROM imagenet WHERE label < 100")
    kept = job_files(cat)
    (cat.root / "jobs" / "x-0123456789ab.roaring").write_bytes(b"left by a crash")
    (cat.root / "jobs" / ".tmp-y-0123456789ab.roaring").write_bytes(b"")
    root = cat.root
    cat.close()
    with catalog.open_catalog(root) as again:
        assert job_files(again) == kept
        assert again.job("a").ids == expected_ids(again, "label < 100")


def test_catalog_with_bitmaps_in_duckdb_is_upgraded(tmp_path):
    """A catalog of tabloader 0.1.0 stored each job's bitmap in a BLOB column."""
    root = tmp_path / "old"
    with catalog.open_catalog(root) as cat:
        cat.import_arrow("t", pa.table({"x": np.arange(100)}))
        cat.register_job("j", "t", where="x % 3 = 0")
        ids = cat.job("j").ids
        con = cat.connection
        con.execute("ALTER TABLE _tabloader.jobs ADD COLUMN ids BLOB")
        con.execute("UPDATE _tabloader.jobs SET ids = ?", [ids.serialize()])
        con.execute("ALTER TABLE _tabloader.jobs DROP COLUMN bitmap")
        con.execute("ALTER TABLE _tabloader.jobs DROP COLUMN crc32")
    for f in (root / "jobs").iterdir():
        f.unlink()
    with catalog.open_catalog(root) as cat:
        assert cat.job("j").ids == ids == BitMap(range(0, 100, 3))
        assert len(job_files(cat)) == 1
