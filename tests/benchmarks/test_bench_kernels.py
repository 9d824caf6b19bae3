from __future__ import annotations

import argparse

from benchmarks import BENCHMARKS, kernels


def test_kernels_benchmark_times_every_arm_and_names_the_cpu(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    out = tmp_path / "kernels.json"
    assert kernels.run(parser.parse_args(["--quick", "--out", str(out)])) == 0
    text = capsys.readouterr().out
    assert "CPU: " in text
    assert "SIMD: " in text
    for arm in ("kernel scalar", "torch", "pillow resize(box)", "draw"):
        assert arm in text
    assert out.exists()
    assert BENCHMARKS["kernels"] == "benchmarks.kernels"


def test_cpu_description_reads_the_simd_level():
    cpu = kernels.cpu_description()
    assert set(cpu) == {"cpu", "simd", "kernel"}
    assert cpu["kernel"] in ("avx2", "scalar", "not built")


def test_force_avx2_sets_the_children_environment_and_the_cpu_line_says_so(monkeypatch):
    """``--simd avx2``: the processes a benchmark starts run tabloader's kernel, numpy and torch
    at AVX2 (their environment), and the CPU line printed with the tables names it."""
    import os

    from benchmarks._cpu import AVX2_ENV, cpu_line, force_avx2

    for name in AVX2_ENV:
        monkeypatch.delenv(name, raising=False)
    assert "forced to AVX2" not in cpu_line()
    force_avx2()
    try:
        assert os.environ["TABLOADER_RESAMPLE"] == "avx2"
        assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
        assert "AVX2" not in os.environ["NPY_DISABLE_CPU_FEATURES"]  # AVX-512 targets only
        assert "forced to AVX2" in cpu_line()
    finally:
        for name in AVX2_ENV:
            monkeypatch.setenv(name, "")  # registered with monkeypatch: removed after the test
            monkeypatch.delenv(name)
