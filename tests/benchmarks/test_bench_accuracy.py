"""``python -m benchmarks accuracy`` at tiny sizes, on a fake digits source (no scikit-learn).

The bench's parent writes the JPEGs and the catalog; its training processes only read them, so
replacing :func:`load_digits` in this process is enough for the whole run. Counts and ranges
only: a model trained one epoch on 60 images is not checked for being accurate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import pytest
from PIL import Image

from benchmarks import accuracy
from tabloader.engine._arena.shm import SHM_DIR, shm_available

CLASSES, PER_CLASS = 10, 6  # 60 images: 10 test (one a class), 50 train


def fake_digits() -> tuple[np.ndarray, np.ndarray]:
    """Digit k: a bright row k % 8 and column k // 2 on 8x8, with some noise."""
    rng = np.random.default_rng(7)
    images = rng.integers(0, 40, (CLASSES * PER_CLASS, 8, 8)).astype(np.uint8)
    labels = np.repeat(np.arange(CLASSES), PER_CLASS)
    for image, k in zip(images, labels, strict=True):
        image[k % 8, :] = 255
        image[:, k // 2] = 255
    return images, labels


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    accuracy.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.catalog = None
    return args


def test_write_digits_splits_each_class_80_20_the_same_way_every_time(tmp_path):
    images, labels = fake_digits()
    counts = accuracy.write_digits(images, labels, tmp_path / "a", 24)
    assert counts == {"train": 50, "test": 10}
    accuracy.write_digits(images, labels, tmp_path / "b", 24)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.jpg"))
    for k in range(CLASSES):
        assert len(list((tmp_path / "a" / str(k) / "test").glob("*.jpg"))) == 1  # round(0.2 * 6)
        assert len(list((tmp_path / "a" / str(k) / "train").glob("*.jpg"))) == 5
    for file in files:  # each file is the digit it names (index), in its class folder
        index = int(file.stem)
        assert int(file.parts[0]) == labels[index]
        with Image.open(tmp_path / "a" / file) as im:
            assert (im.size, im.mode, im.format) == ((24, 24), "RGB", "JPEG")
            small = np.asarray(im.convert("L").resize((8, 8), Image.Resampling.BOX), np.int16)
        assert np.abs(small - images[index]).mean() < 20


def test_compare_against_the_seeds_noise():
    same = accuracy.compare([0.95, 0.97, 0.96], [0.96, 0.95, 0.97])
    assert same["diff_pp"] == pytest.approx(0.0, abs=1e-9)
    assert same["under_1pp"]
    assert same["within_noise"]
    a, b = [0.90, 0.92, 0.94], [0.97, 0.98, 0.99]
    apart = accuracy.compare(a, b)
    assert apart["diff_pp"] == pytest.approx(-6.0)
    assert apart["se_pp"] == pytest.approx(100 * math.sqrt(0.02**2 / 3 + 0.01**2 / 3))
    assert apart["welch_t"] == pytest.approx(apart["diff_pp"] / apart["se_pp"])
    assert not apart["under_1pp"]
    assert not apart["within_noise"]
    if apart["welch_p"] is not None:  # SciPy installed: Welch's test, as SciPy computes it
        from scipy.stats import ttest_ind

        assert 0 < apart["welch_p"] < 0.05
        assert apart["welch_p"] == pytest.approx(ttest_ind(a, b, equal_var=False).pvalue)
    agreed = accuracy.compare([0.97] * 3, [0.96, 0.97, 0.98])  # models that agree: no warning
    assert agreed["welch_p"] is None or 0.9 < agreed["welch_p"] <= 1
    exact = accuracy.compare([1.0], [0.5])  # one model each: no spread, no noise to hide in
    assert exact["se_pp"] == 0
    assert not exact["within_noise"]
    assert accuracy.summarize([0.5, 1.0]) == {
        "n": 2,
        "mean": 0.75,
        "std": pytest.approx(math.sqrt(0.125)),
        "min": 0.5,
        "max": 1.0,
    }


@pytest.mark.slow  # about 20 s: a service and four training processes
@pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")
def test_quick_run_trains_every_model_of_both_arms_and_cleans_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(accuracy, "load_digits", fake_digits)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the bench's work and sync folders
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))
    out = tmp_path / "accuracy.json"
    args = parsed(
        *("--quick", "--seeds", "1", "--jobs", "2", "--size", "16", "--batch-size", "8"),
        *("--out", str(out)),
    )
    assert accuracy.run(args) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["args"]["epochs"] == 1  # --quick
    assert data["images"] == {"train": 50, "test": 10}
    assert data["augment"] == accuracy.AUGMENT.format(size=16)
    models = data["models"]
    assert sorted((m["arm"], m["seed"]) for m in models) == sorted(
        (arm, seed) for arm in ("tabloader", "dataloader") for seed in (1, 2)
    )
    for m in models:
        assert 0 <= m["accuracy"] <= 1
        assert m["test_images"] == 10
        assert m["rows"] == 50  # one epoch of the train split, the test split never
        assert math.isfinite(m["loss"])
    for arm, summary in data["arms"].items():
        accs = [m["accuracy"] for m in models if m["arm"] == arm]
        assert summary["n"] == 2
        assert summary["mean"] == pytest.approx(np.mean(accs))
        assert (summary["min"], summary["max"]) == (min(accs), max(accs))
        assert summary["std"] == pytest.approx(np.std(accs, ddof=1))
    diff = 100 * (data["arms"]["tabloader"]["mean"] - data["arms"]["dataloader"]["mean"])
    assert data["comparison"]["diff_pp"] == pytest.approx(diff)
    runs = data["runs"]
    assert [(r["arm"], r["run"]) for r in runs] == [("tabloader", 0), ("dataloader", 0)]
    for r in runs:
        if r["arm"] == "tabloader":  # two jobs at once, each train image decoded once
            assert 50 <= r["decodes"] <= 1.05 * 50
        else:
            assert r["decodes"] == 2 * 50
    assert "tabloader - dataloader:" in printed
    assert "within the seeds' noise" in printed
    # clean-up: the services stopped and removed their memory; the work folder is gone
    for r in runs[:1]:  # the tabloader arm's
        assert not list(SHM_DIR.glob(f"tabloader-{r['service_pid']}-*"))
        with pytest.raises(ProcessLookupError):
            os.kill(r["service_pid"], 0)
    assert not list(tmp_path.glob("tabloader-*"))


def test_a_missing_scikit_learn_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(SystemExit, match="needs scikit-learn.*pip install scikit-learn"):
        accuracy.load_digits()


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--size", "4"), "--size 4: give 8 to 256 pixels"),
        (("--size", "300"), "--size 300: give 8 to 256 pixels"),
        (("--lr", "0"), "--lr 0.0: give a positive learning rate"),
        (("--lr", "nan"), "--lr nan: give a positive learning rate"),
    ],
)
def test_bad_options_are_named(argv, problem):
    with pytest.raises(SystemExit, match=problem):
        accuracy.run(parsed(*argv))


def test_bench_accuracy_is_registered(capsys):
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["accuracy", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m benchmarks accuracy")
    for option in ("--epochs", "--seeds", "--jobs", "--size", "--quick", "--out"):
        assert option in out
