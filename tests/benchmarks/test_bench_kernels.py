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
