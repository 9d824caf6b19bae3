"""``tabloader bench analyze``: the analysis' predictions beside the same configurations run."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import BENCHMARKS, predictions


def test_the_benchmark_runs_what_the_analysis_predicted_and_reports_the_errors(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    predictions.add_arguments(parser)
    out = tmp_path / "analyze.json"
    argv = ["--quick", "--images", "300", "--data", str(tmp_path), "--out", str(out)]
    assert predictions.run(parser.parse_args(argv)) == 0
    text = capsys.readouterr().out
    assert "CPU: " in text
    assert "median |error|" in text
    assert "worst |error|" in text
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"cold_storage", "cached", "cached_step", "cold", "cold_one"}
    (config,) = result["configs"]  # --quick: one decode process, the cache 2x, 2 jobs
    assert (config["workers"], config["cache"], config["jobs"]) == (1, 2.0, 2)
    measured, predicted = config["measured"], config["predicted"]
    assert measured["epoch_s"] > 0
    assert predicted["epoch_s"] > 0
    # the error is of the prediction itself; the JSON holds it rounded to 4 decimals (0.00005 s
    # off at most: a part in ~5,000 of a quick epoch of 0.25 s, more than a relative 1e-3 of an
    # error of 3%, which failed a run here)
    rounding = 0.5e-4 / measured["epoch_s"]
    assert config["error"] == pytest.approx(
        predicted["epoch_s"] / measured["epoch_s"] - 1, rel=1e-9, abs=rounding
    )
    assert result["median_error"] == abs(config["error"])
    # both jobs read every row once, the cache holds them all: each row decoded once
    assert measured["decodes_per_row"] == 0.5
    assert predicted["decodes_per_row"] == 0.5
    assert len(measured["jobs_epoch_s"]) == 2
    assert BENCHMARKS["analyze"] == "benchmarks.predictions"
