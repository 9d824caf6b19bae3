"""Parts of ``python -m benchmarks throughput`` that a run on a machine without them would hide."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks._coldstart import TARGET_COLD_S, cold_start, report
from benchmarks.throughput import _jpeg_libraries
from tabloader.datagen import make_imagefolder
from tabloader.engine._arena.shm import process_alive, shm_available


def test_jpeg_libraries_are_timed_or_say_why_not(images, monkeypatch):
    monkeypatch.setenv("TURBOJPEG_LIB", "/nonexistent/libturbojpeg.so")  # as on a bare machine
    rows = _jpeg_libraries(images, 4)
    assert [(r["size"], r["library"]) for r in rows] == [
        (size, lib) for size in (224, 112) for lib in ("simplejpeg", "pyturbojpeg", "pillow draft")
    ]
    for r in rows:
        if r["library"] == "pyturbojpeg":
            assert r["ms_per_image"].startswith("not measured: ")
            fix = "TURBOJPEG_LIB" if importlib.util.find_spec("turbojpeg") else "pip install"
            assert fix in r["ms_per_image"]
        else:
            assert float(r["ms_per_image"]) > 0


def test_cold_start_times_each_competitor_and_stops_the_service_it_started(tmp_path, capsys):
    folder = make_imagefolder(tmp_path / "imgs", num_images=64, num_classes=2, size=(64, 48))
    result = cold_start(folder, tmp_path, workers=2, rounds=1)
    assert sorted(result["runs"]) == ["cold", "dataloader", "warm"]
    for name, runs in result["runs"].items():
        assert len(runs) == 1, name
        assert runs[0] > 0, name
        assert result["best"][name] == runs[0]
    assert [process_alive(pid) for pid in result["services"]] == [False]
    verdict = report(result)
    assert verdict["result"] == ("PASS" if result["best"]["cold"] <= TARGET_COLD_S else "FAIL")
    assert "time to first batch" in capsys.readouterr().out


def _bench(tmp_path, name: str, *args: str, codes=(0,)) -> dict:
    """``python -m benchmarks NAME ARGS`` as the CLI in a subprocess (a hang fails the test); its
    JSON. ``codes``: the exit statuses allowed (``bench throughput`` exits 1 for a missed
    target: timings, on a shared machine)."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", name, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode in codes, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    data["stdout"] = proc.stdout
    return data


@pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")
def test_tiny_compares_one_job_with_dataloaders_and_four_jobs_with_one(tmp_path):
    rows = 300
    data = _bench(
        tmp_path,
        "throughput",
        *("--only", "tiny", "--rounds", "1", "--workers", "2", "--tiny-rows", str(rows)),
        *("--tiny-batch", "32", "--tiny-dataloader-rows", "64"),
        *("--tiny-data", str(tmp_path / "tiny")),
        codes=(0, 1),
    )
    tiny = data["tiny"]
    assert tiny["rows"] == rows
    assert "SIMD:" in tiny["cpu"]
    assert "SIMD:" in data["stdout"]
    got = {(r["mode"], r["competitor"]): r for r in tiny["table"]}
    assert set(got) == {
        *(("dataloader(2)", v) for v in ("arrow, pillow", "arrow, simplejpeg", "folder, pillow")),
        *((m, j) for m in ("in-process", "service") for j in ("1 job", "4 jobs")),
    }
    for (mode, what), r in got.items():
        assert r["rows/s"] > 0
        assert r["cpu ms/row"] >= 0  # CPU comes in 10 ms clock ticks: a short run may read 0
        if mode != "dataloader(2)":
            assert r["decodes"] >= rows, (mode, what)  # every row decoded at least once
    assert sum(r["cpu ms/row"] for r in got.values()) > 0
    for run in tiny["runs"].values():  # every job read its whole epoch
        for r in run:
            assert r["rows"] in (rows, 4 * rows) or r["rows"] >= 64
    assert [t["check"] for t in tiny["targets"]] == [
        f"{m}: {c}"
        for m in ("in-process", "service")
        for c in ("1 job / best dataloader(2)", "4 jobs / 1 job (rows/s delivered)")
    ]
    assert all(t["result"] in ("PASS", "FAIL") for t in tiny["targets"])
    assert data["targets"][-4:] == tiny["targets"]
