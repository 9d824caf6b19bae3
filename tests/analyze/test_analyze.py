"""``tabloader analyze JOB`` on a tiny dataset: the differential runs, the figures, the
predictions, ``--json``, ``--plot`` and the refusals."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os

import pytest

from tabloader import analyze as analysis_api
from tabloader import catalog
from tabloader.catalog._errors import JobNotFoundError, ServiceError
from tabloader.cli import main
from tabloader.service._protocol import runtime_dir


@pytest.fixture(scope="module")
def analysed(tmp_path_factory, image_catalog):
    """``analyze --json --plot`` of job ``a`` (60 images at 16 pixels, batches of 8) beside
    job ``b`` (the rows of labels 0 and 1), through the CLI, once for the module: (argv, its
    exit code and output, the Analysis it printed, the plot's path, b's rows)."""
    import shutil

    root = tmp_path_factory.mktemp("analyze") / "cat"
    shutil.copytree(image_catalog, root)
    with catalog.open_catalog(root) as cat:
        cat.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size=16, batch_size=8)")
        cat.sql("REGISTER JOB b SELECT image FROM imgs WHERE label < 2 WITH (image_size=16)")
        shared = cat.sql("SELECT count(*) AS n FROM imgs WHERE label < 2").column(0)[0].as_py()
    png = root.parent / "stalls.png"
    argv = ["--catalog", str(root), "analyze", "a", "--step", "0.01", "--workers", "1"]
    argv += ["--batches", "2", "--seconds", "0"]
    argv += ["--what-if", "workers=2", "--what-if", "jobs=2,cache_bytes=1MiB"]
    argv += ["--epochs", "2", "--json", "--plot", str(png)]
    real, kept = analysis_api.analyze, []

    def keep(*args, **kwargs):
        kept.append(real(*args, **kwargs))
        return kept[-1]

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as out:
        patch.setattr(analysis_api, "analyze", keep)
        code = main(argv)
    return argv, code, out.getvalue(), kept, png, shared


def test_analyze_measures_the_rates_and_the_sharing(analysed):
    _, code, printed, _, png, shared = analysed
    assert code == 0
    out = json.loads(printed)
    m = out["measured"]
    assert (m["job"], m["rows"], m["batch_size"], m["workers"]) == ("a", 60, 8, 1)
    runs = m["runs"]  # one decode process: no cold_one run (bench analyze's test has one)
    assert set(runs) == {"cold_storage", "cached", "cached_step", "cold"}
    read = runs["cold_storage"]["rows"]
    assert read >= 2 * 8  # its batches (and the prefetched ones, of the 30 it could read)
    assert runs["cold"]["rows"] == read  # as many batches of other rows, every one decoded
    assert runs["cold"]["decodes"] == runs["cold"]["reads"] >= read  # (and those prefetched)
    assert runs["cold_storage"]["decodes"] >= read
    assert runs["cached"]["decodes"] == 0  # the same rows again: all cached
    assert runs["cached"]["hits"] == runs["cached"]["lookups"] == runs["cached"]["rows"] >= read
    assert runs["cached_step"]["step_s"] == pytest.approx(0.01 * runs["cached_step"]["batches"])
    assert m["ingestion_rows_per_s"] < 8 / 0.01  # the step bounds the loop
    assert m["prep"]["rows_per_s_per_process"] > 0
    assert m["prep"]["read_s_per_row"] > 0
    assert m["prep"]["decode_s_per_row"] > 0
    assert m["cache_fetch"]["rows_per_s"] > 0
    assert m["storage"]["bytes_per_row"] > 0
    assert m["storage"]["page_cache"].startswith("dropped")
    assert m["decoded_bytes_per_row"] >= 16 * 16 * 3
    assert m["sharing"] == [
        {
            "job": "b",
            "rows": shared,
            "shared": shared,
            "fraction": shared / 60,
            "same_decode": True,
            "union": 60,
        }
    ]
    predictions = out["predictions"]
    assert [p["what_if"] for p in predictions] == [
        {},
        {"workers": 2},
        {"cache_bytes": 1 << 20, "jobs": 2},
    ]
    for p in predictions:
        assert p["epoch_s"] > 0
        assert 0 <= p["stall_fraction"] <= 1
        assert len(p["epochs_s"]) == len(p["bound"]) == 2
    assert predictions[0]["decodes_per_row"] == pytest.approx(0.5)  # cached in epoch 2
    assert predictions[2]["decodes_per_row"] == pytest.approx(60 / 240)  # b's rows are a's
    assert png.read_bytes().startswith(b"\x89PNG")


def test_analyze_prints_a_table_by_default(analysed, capsys, monkeypatch):
    """The plain report of the fixture's analysis (not profiled again)."""
    argv, _, _, (analysis,), _, _ = analysed
    monkeypatch.setattr(analysis_api, "analyze", lambda *a, **k: analysis)
    assert main(argv[: argv.index("--json")]) == 0  # nor drawn again
    text = capsys.readouterr().out
    for shown in ("ingestion G:", "prep P:", "cache fetch C:", "storage fetch S:", "sharing: b"):
        assert shown in text
    assert "(as analysed)" in text
    assert "cache_bytes=1MiB,jobs=2" in text


def test_analyze_refuses_what_it_cannot_measure(image_cat_dir, capsys):
    root = image_cat_dir
    assert main(["--catalog", str(root), "analyze", "a", "--what-if", "gpus=8"]) == 1
    assert "'gpus=8' is not KEY=VALUE" in capsys.readouterr().err
    with pytest.raises(JobNotFoundError, match="nope"):
        analysis_api.profile_job(root, "nope")
    with pytest.raises(catalog.LoaderError, match="at least 1 batch"):
        analysis_api.profile_job(root, "a", batches=0)
    lock = runtime_dir(root) / "lock"  # held as a running service holds it
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242")
        with pytest.raises(ServiceError, match=r"\(pid 4242\); tabloader analyze measures"):
            analysis_api.profile_job(root, "a")
    finally:
        os.close(fd)
