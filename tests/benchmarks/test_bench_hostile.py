"""``python -m benchmarks hostile``: the neighbour job's epochs beside a job over bombs."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import BENCHMARKS, hostile
from tests.support.bombs import bomb, with_size


def test_the_hostile_benchmark_times_the_neighbour_beside_a_clean_job_and_the_bombs(
    tmp_path, capsys
):
    parser = argparse.ArgumentParser()
    hostile.add_arguments(parser)
    out = tmp_path / "hostile.json"
    assert hostile.run(parser.parse_args(["--quick", "--out", str(out)])) == 0
    text = capsys.readouterr().out
    assert "CPU: " in text
    assert "SIMD: " in text
    assert "beside the bombs' job" in text
    assert "target: neighbour beside the bombs / alone" in text
    result = json.loads(out.read_text())
    assert len(result["alone_s"]) == 3
    # the clean twin skips nothing; the bombs' job skips its 5 bombs every epoch it ran
    assert result["twin"]["second_skipped"] == 0
    bombs = result["bombs"]
    assert bombs["second_skipped"] > 0
    assert bombs["second_skipped"] % 5 == 0
    assert bombs["second_rows"] > 0
    assert bombs["second_rows"] % 100 == 0
    assert BENCHMARKS["hostile"] == "benchmarks.hostile"


def test_bombs_of_an_unknown_kind_or_format_are_refused():
    with pytest.raises(ValueError, match="no bomb of kind 'zip'"):
        bomb("zip")
    with pytest.raises(ValueError, match="not a format with_size knows"):
        with_size(b"BM" + bytes(60), 10, 10)
