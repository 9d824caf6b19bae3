"""``python -m benchmarks importance`` runs SHADE's experiment side by side: its quick run trains
both arms, measures agreement against the coupling bound, the plain jobs' uniformity, the
cache's hit ratios against LRU and MIN, and three jobs through the service.

The digits come from scikit-learn, which the tests do not install: a generated stand-in of
the same shape replaces :func:`load_digits` in this process (the served part reads JPEGs it
writes from them)."""

from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks import importance


def fake_digits() -> tuple[np.ndarray, np.ndarray]:
    """600 8x8 "digits": class k a bright row k % 8 and column k // 2, with noise."""
    rng = np.random.default_rng(3)
    labels = np.repeat(np.arange(10), 60)
    images = rng.integers(0, 60, (labels.size, 8, 8)).astype(np.uint8)
    for image, k in zip(images, labels, strict=True):
        image[k % 8, :] = 255
        image[:, k // 2] = 255
    return images, labels


def test_the_quick_run_reports_every_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(importance, "load_digits", fake_digits)
    out = tmp_path / "importance.json"
    parser = argparse.ArgumentParser()
    importance.add_arguments(parser)
    args = parser.parse_args(["--quick", "--out", str(out)])
    assert importance.run(args) == 0
    printed = capsys.readouterr().out
    for heading in ("importance acc %", "coupling bound", "tabloader / LRU", "decodes / union"):
        assert heading in printed
    result = json.loads(out.read_text())
    assert len(result["curves"]["importance"]) == 3  # --quick: 3 epochs, 2 seeds
    assert result["final"]["uniform"]["n"] == 2
    ratio = np.asarray(result["agreement"]) / np.asarray(result["bound"])
    # the maximal coupling: 3 epochs of 480 rounds give a standard error near 2.5% per run
    assert ((ratio > 0.85) & (ratio < 1.1)).all()
    assert max(result["uniformity"]) < importance.CHI2_99_81 * 1.2
    service = result["service"]
    assert service["decodes"] <= 1.1 * service["union"]  # decoded once for the three jobs
    assert service["requests"] > 2 * service["decodes"]


def test_statistics_against_hand_computations():
    ids = np.arange(4)
    # leader order 2, 0, 3, 1; q concentrated on row 1: min(p, q) is q_1 only while 1 is left
    q = np.array([0.0, 1.0, 0.0, 0.0])
    bound = importance.agreement_bound(np.array([2, 0, 3, 1]), ids, q)
    np.testing.assert_allclose(bound, [1 / 4, 1 / 3, 1 / 2, 1.0])
    ids10 = np.arange(10)
    rng = np.random.default_rng(0)
    fair = [rng.permutation(ids10) for _ in range(200)]
    biased = [np.sort(ids10) for _ in range(200)]  # always in id order
    assert importance.uniformity(fair, ids10) < importance.CHI2_99_81
    assert importance.uniformity(biased, ids10) > 10 * importance.CHI2_99_81
