"""The demo and the examples run end to end (small sizes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tabloader._demo import DEMO_JOBS, run_demo

ROOT = Path(__file__).resolve().parents[1]


def run_example(script: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script>`` on 120 generated images (2 epochs at 32 px) in ``tmp_path``;
    it must succeed."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / script),
            "--catalog",
            str(tmp_path / "cat"),
            "--data",
            str(tmp_path / "data"),
            "--images",
            "120",
            "--epochs",
            "2",
            "--image-size",
            "32",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_demo(cat, tmp_path, capsys):
    sizes = run_demo(cat, data_dir=tmp_path / "data", num_images=80, num_classes=10)
    out = capsys.readouterr().out
    assert set(sizes) == set(DEMO_JOBS)
    for name, n in sizes.items():
        assert cat.job(name).num_rows == n
    assert "shared rows" in out
    served, decoded = map(int, re.search(r"(\d+) images served .* decoded (\d+)", out).groups())
    assert served == sum(sizes.values())
    union = cat.job("resnet18").ids | cat.job("vit_small").ids | cat.job("finetune").ids
    assert decoded == len(union)
    again = run_demo(cat, data_dir=tmp_path / "data", num_images=80, num_classes=10)
    assert again == sizes


def test_hparam_search_example(tmp_path):
    proc = run_example("hparam_search.py", tmp_path)
    assert proc.stdout.count("epoch 1:") == 3
    served, decoded = map(
        int, re.search(r"served to jobs: (\d+); decoded: (\d+)", proc.stdout).groups()
    )
    assert decoded < served
    lines = re.findall(
        r"(\d+) images: (\d+) decoded by this job, (\d+) served from the cache", proc.stdout
    )
    assert len(lines) == 3
    rows, ours, shared = (sum(int(line[i]) for line in lines) for i in range(3))
    assert ours + shared == rows == served
    assert ours == decoded  # every decode was done by exactly one job's batch


@pytest.mark.xdist_group("ray")  # one Ray at a time (see tests/conftest.py)
def test_ray_tune_example_trials_share_decodes(tmp_path):
    """A Ray Tune search (local Ray on loopback) whose trials read through the node loader."""
    pytest.importorskip("ray.tune", reason="ray[tune] is not installed")
    # two trials show the sharing as well as three: each trial's Ray worker imports torch and
    # the job's loader (a third trial cost 7.5 CPU-s of the suite's ~700)
    proc = run_example("ray_tune_search.py", tmp_path, "--trials", "2")
    assert len(re.findall(r"trial_\d: lr [\d.]+, final loss [\d.]+", proc.stdout)) == 2
    served, decoded = map(
        int, re.search(r"images served to trials: (\d+); decoded: (\d+)", proc.stdout).groups()
    )
    assert served == 2 * 2 * 120  # every trial read every image, each epoch
    assert 120 <= decoded <= 1.05 * 2 * 120  # at most once per image and epoch, not per trial
