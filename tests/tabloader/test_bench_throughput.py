"""Parts of ``tabloader bench throughput`` that a run on a machine without them would hide."""

from __future__ import annotations

import importlib.util

from tabloader.bench._coldstart import TARGET_COLD_S, cold_start, report
from tabloader.bench.throughput import _jpeg_libraries
from tabloader.datagen import make_imagefolder
from tabloader.engine.shm import process_alive


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
