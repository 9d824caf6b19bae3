from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tabloader
from tabloader import catalog, cli
from tabloader.cli import main
from tests.support.imports import imported_after


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tabloader {tabloader.__version__}"


def test_import_sql_and_errors(capsys, tmp_path):
    root = str(tmp_path / "cat")
    pq.write_table(pa.table({"label": list(range(20)), "b": [b"x"] * 20}), tmp_path / "d.parquet")
    code, out, _ = run(capsys, "--catalog", root, "import", "d", str(tmp_path / "d.parquet"))
    assert code == 0
    assert "Dataset d version 1: 20 rows" in out
    code, out, _ = run(
        capsys, "--catalog", root, "sql", "REGISTER JOB j SELECT b FROM d WHERE label < 5"
    )
    assert (code, out.strip()) == (0, "Job j on d (version 1): 5 rows, columns b")
    code, out, _ = run(capsys, "--catalog", root, "sql", "SHOW JOBS")
    lines = out.splitlines()
    assert lines[0].split() == [
        "name",
        "dataset",
        "version",
        "rows",
        "columns",
        "predicate",
        "options",
    ]
    assert lines[2].split()[:5] == ["j", "d", "1", "5", "b"]
    code, out, err = run(capsys, "--catalog", root, "sql", "SELECT labl FROM d")
    assert code == 1
    assert out == ""
    assert err.startswith("StatementError: ")
    assert len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "--catalog", root, "sql", "DESCRIBE dd")
    assert code == 1
    assert err.strip() == (
        f"DatasetNotFoundError: Unknown dataset 'dd' in catalog '{root}'. Did you mean 'd'? SHOW "
        "DATASETS lists them; CREATE DATASET imports one."
    )
    with pytest.raises(tabloader.DatasetNotFoundError):
        main(["--catalog", root, "--debug", "sql", "DESCRIBE dd"])


@pytest.mark.parametrize(
    ("root", "problem"),
    [
        pytest.param(
            "/proc/nope",
            "No such file or directory",
            marks=pytest.mark.skipif(sys.platform != "linux", reason="needs /proc"),
        ),
        ("{tmp}/file/x", "Not a directory"),
        ("{tmp}/data_is_a_file", "File exists"),
    ],
)
def test_unusable_catalog_path_is_one_line(capsys, tmp_path, root, problem):
    (tmp_path / "file").write_text("x")
    (tmp_path / "data_is_a_file").mkdir()
    (tmp_path / "data_is_a_file" / "data").write_text("x")
    pq.write_table(pa.table({"a": [1]}), tmp_path / "d.parquet")
    path = str(tmp_path / "d.parquet")
    code, out, err = run(capsys, "--catalog", root.format(tmp=tmp_path), "import", "d", path)
    assert (code, out) == (1, "")
    assert err.startswith(f"CatalogError: Cannot use '{root.format(tmp=tmp_path)}' as a catalog")
    assert problem in err
    assert len(err.strip().splitlines()) == 1


def test_refused_statement_is_one_line(tmp_path):
    """In a process of its own: under pytest, logging.basicConfig would not reach stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "tabloader", "--catalog", str(tmp_path), "sql", "LOAD httpfs"],
        capture_output=True,
        text=True,
    )
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.startswith("ForbiddenExpressionError: Statements starting with 'LOAD'")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_statements_from_stdin(capsys, monkeypatch, tmp_path):
    root = str(tmp_path / "cat")
    tabloader.connect(root, create=True).close()
    monkeypatch.setattr(sys, "stdin", io.StringIO("SELECT 1 AS a;\nSELECT 'x;y' AS b;\n"))
    code, out, _ = run(capsys, "--catalog", root, "sql", "-")
    assert code == 0
    assert out.split() == ["a", "-", "1", "b", "---", "x;y"]


def test_console_script_entry_point(tmp_path):
    tabloader.connect(tmp_path / "c", create=True).close()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tabloader",
            "--catalog",
            str(tmp_path / "c"),
            "sql",
            "SHOW DATASETS",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == [
        "name",
        "version",
        "rows",
        "columns",
        "jobs",
        "source",
    ]


@pytest.mark.parametrize("where", ["before", "after"])
def test_reads_refuse_a_directory_that_is_not_a_catalog(capsys, tmp_path, where):
    root = tmp_path / "typo"
    argv = ["sql", "--catalog", str(root)] if where == "after" else ["--catalog", str(root), "sql"]
    code, out, err = run(capsys, *argv, "SHOW DATASETS")
    assert (code, out) == (1, "")
    assert err.strip() == (
        f"CatalogError: '{root}' is not a tabloader catalog (it does not exist). Give the "
        "catalog's directory (--catalog DIR or $TABLOADER_CATALOG), or create one there by "
        f"importing data: tabloader --catalog {root} import NAME PATH, CREATE DATASET name FROM "
        f"'path', or catalog.open_catalog('{root}', create=True)."
    )
    assert not root.exists()  # nothing was created


def test_global_options_after_the_subcommand(capsys, tmp_path):
    root = tmp_path / "cat"
    pq.write_table(pa.table({"a": [1, 2]}), tmp_path / "d.parquet")
    code, out, _ = run(capsys, "import", "d", str(tmp_path / "d.parquet"), "--catalog", str(root))
    assert code == 0
    code, out, _ = run(capsys, "sql", "--catalog", str(root), "-q", "SELECT count(*) AS n FROM d")
    assert (code, out.split()) == (0, ["n", "-", "2"])
    code, out, _ = run(capsys, "--catalog", str(root), "sql", "--debug", "SHOW DATASETS")
    assert code == 0
    assert out.splitlines()[2].split()[0] == "d"


def test_show_jobs_shows_whole_predicates_wrapped(capsys, tmp_path):
    root = str(tmp_path / "cat")
    pq.write_table(pa.table({"x": list(range(10)), "y": list(range(10))}), tmp_path / "d.parquet")
    assert run(capsys, "--catalog", root, "import", "d", str(tmp_path / "d.parquet"))[0] == 0
    where = " OR ".join(f"(x = {i} AND y BETWEEN {i} AND {i + 100})" for i in range(6))
    assert len(where) > 150
    assert (
        run(capsys, "--catalog", root, "sql", f"REGISTER JOB j SELECT x FROM d WHERE {where}")[0]
        == 0
    )
    code, out, _ = run(capsys, "--catalog", root, "sql", "SHOW JOBS")
    assert code == 0
    lines = out.splitlines()
    start = lines[0].index("predicate")
    shown = " ".join(line[start:].split(" " * 2)[0].strip() for line in lines[2:])
    assert " ".join(shown.split()) == where  # every word, in order: nothing cut
    assert max(len(line) for line in lines) < len(where)  # wrapped, not one long line


def test_sql_help_shows_the_statement_grammar_and_job_options(capsys):
    from tabloader.catalog._options import JOB_OPTIONS

    with pytest.raises(SystemExit) as done:
        main(["sql", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for form in ("CREATE DATASET", "APPEND TO DATASET", "REGISTER [OR REPLACE] JOB", "DESCRIBE"):
        assert form in out
    for key in JOB_OPTIONS:
        assert f"  {key} " in out


def test_status_without_a_service_and_outside_a_catalog(capsys, tmp_path):
    code, _, err = run(capsys, "--catalog", str(tmp_path / "nope"), "status")
    assert code == 1
    assert "is not a tabloader catalog" in err
    assert str(tmp_path / "nope") in err
    root = str(tmp_path / "cat")
    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "d.parquet")
    assert run(capsys, "--catalog", root, "import", "d", str(tmp_path / "d.parquet"))[0] == 0
    code, out, _ = run(capsys, "status", "--catalog", root)  # options after the command too
    assert code == 0
    assert out.startswith("No loader service runs for catalog")
    code, out, _ = run(capsys, "--catalog", root, "status", "--json")
    assert (code, json.loads(out)) == (
        0,
        {"catalog": root, "service_pid": None, "clients": [], "jobs": [], "ray": None},
    )


def test_status_names_the_ranks_of_a_data_parallel_job():
    from tabloader.cli import _client

    ranks = [{"job": "cnn", "rank": r, "world_size": 2} for r in (0, 1)]
    client = {
        "pid": 7,
        "connections": 3,
        "jobs": [*ranks, {"job": "vit", "rank": 0, "world_size": 1}],
    }
    assert _client(client) == "pid 7: cnn[0/2], cnn[1/2], vit"
    assert _client({"pid": 8, "connections": 1, "jobs": []}) == "pid 8: no job"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--cache-bytes", str(10**15)], {}, r"--cache-bytes '1000000000000000' is above the"),
        (["--cache-bytes", "17"], {}, r"--cache-bytes '17' is below the range: .* from 1\.0 MiB"),
        (["--cache-bytes", "0"], {}, r"--cache-bytes '0' is below the range"),
        (["--cache-bytes", "lots"], {}, r"--cache-bytes 'lots' is not a size; .* e\.g\. '2GiB'"),
        ([], {"TABLOADER_CACHE_BYTES": "abc"}, r"\$TABLOADER_CACHE_BYTES 'abc' is not a size"),
        (["--workers", "0"], {}, r"--workers '0' is below the range: decode processes"),
        (["--workers", "two"], {}, r"--workers 'two' is not a whole number"),
        (["--idle-exit", "-1"], {}, r"--idle-exit '-1' is below the range"),
        (["--idle-exit", "nan"], {}, r"--idle-exit 'nan' is not a number"),
    ],
)
def test_serve_refuses_bad_sizes_in_one_line(capsys, monkeypatch, tmp_path, argv, env, message):
    """Every size of ``serve`` goes through tabloader.catalog._settings: one line, before anything
    starts
    (no numpy allocation error, no silent default, no traceback)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["--catalog", str(tmp_path / "cat"), "serve", *argv]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("CatalogError: "), err
    assert re.search(message, err), err


def test_names_and_values_with_terminal_escapes_are_printed_inert(capsys, tmp_path):
    red = "\x1b[31m"
    with catalog.open_catalog(tmp_path / "cat") as cat:
        cat.import_arrow("t", pa.table({"s": [f"{red}red", "plain\x07"]}))
    root = str(tmp_path / "cat")
    assert main(["--catalog", root, "sql", f'SELECT s AS "x{red}" FROM t']) == 0
    assert main(["--catalog", root, "sql", f'DESCRIBE "t{red}"']) == 1
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err
    assert "\x07" not in out
    assert "\\x1b[31mred" in out
    assert "x\\x1b[31m" in out  # the column's name
    assert "plain\\x07" in out
    assert "t\\x1b[31m" in err  # a name in an error message


def test_import_refuses_links_out_unless_follow_links(capsys, tmp_path):
    root = str(tmp_path / "cat")
    (tmp_path / "images" / "cat").mkdir(parents=True)
    (tmp_path / "secret.jpg").write_bytes(b"secret")
    link = tmp_path / "images" / "cat" / "x.jpg"
    link.symlink_to(tmp_path / "secret.jpg")
    code, out, err = run(capsys, "--catalog", root, "import", "d", str(tmp_path / "images"))
    assert (code, out) == (1, "")
    assert err.startswith(f"ImportFailedError: '{link}' is a symbolic link to '")
    assert "--follow-links on the command line" in err
    args = ("--catalog", root, "import", "d", str(tmp_path / "images"), "--follow-links")
    code, out, _ = run(capsys, *args)
    assert (code, "Dataset d version 1: 1 rows" in out) == (0, True)


@pytest.mark.parametrize("argv", [["status"], ["sql", "SELECT 1 AS a"]], ids=" ".join)
def test_a_closed_stdout_pipe_ends_a_command_quietly(tmp_path, argv):
    """``tabloader status | head -1``: the reader is gone before the first write here, so every
    write fails as it can after ``head`` read its line."""
    root = tmp_path / "cat"
    tabloader.connect(root, create=True).close()
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tabloader", "--catalog", str(root), *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    """A service's socket that breaks is not a reader of stdout that left: it is raised."""

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe (the service's socket)")

    monkeypatch.setitem(cli.COMMANDS, "status", (cli.COMMANDS["status"][0], broken))
    with pytest.raises(BrokenPipeError, match=r"the service's socket"):
        main(["status"])


def test_a_started_service_parses_serve_alone_and_imports_only_what_serving_needs(tmp_path):
    """A client-started service's parser knows ``serve`` only (the other commands' help
    imported ``tabloader.analyze``), and serving imports no HTTP server (``http.server`` and
    ``ssl``: only ``--metrics-port`` needs them), each on the path to a cold first batch."""
    args = cli.build_parser(("serve",)).parse_args(
        ["--catalog", str(tmp_path), "serve", "--idle-exit", "3"]
    )
    assert (args.command, args.catalog, args.idle_exit) == ("serve", str(tmp_path), "3")
    with pytest.raises(SystemExit):  # another command is unknown to it
        cli.build_parser(("serve",)).parse_args(["sql", "SHOW JOBS"])
    code = (
        "from tabloader.cli import build_parser; build_parser(('serve',)); "
        "import tabloader.service._server"
    )
    assert imported_after(code, ("tabloader.analyze", "http.server", "ssl")) == []


def test_the_parser_of_every_command_imports_no_analysis_and_no_numpy():
    """Every ``tabloader`` command builds the whole parser: ``analyze``'s defaults come from a
    module of their own, not the analysis (numpy, the engine, the service's client: 0.1-0.2 s
    of every command)."""
    code = "from tabloader.cli import build_parser; build_parser()"
    assert imported_after(code, ("tabloader.analyze._profile", "numpy")) == []
