"""Parts of ``tabloader bench throughput`` that a run on a machine without them would hide."""

from __future__ import annotations

import importlib.util

from tabloader.bench.throughput import _jpeg_libraries


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
