"""CI's lint: ruff (lint and format) and mypy --strict, run as part of the test suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["tabloader", "benchmarks", "tests", "examples", "scripts"]


@pytest.mark.parametrize(
    "argv",
    [
        ["ruff", "check", *PATHS],
        ["ruff", "format", "--check", *PATHS],
        [sys.executable, "-m", "mypy", "--strict", "tabloader", "benchmarks"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_lint(argv):
    if argv[0] == "ruff":
        ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
        argv = [ruff, *argv[1:]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
