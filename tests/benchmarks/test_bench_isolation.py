"""``tabloader bench isolation``: an observer job beside each attack on the service."""

from __future__ import annotations

import argparse
import json

from benchmarks import BENCHMARKS, isolation
from tests.support import attacks as harness


def test_the_isolation_benchmark_reports_the_observer_beside_each_attack(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    isolation.add_arguments(parser)
    out = tmp_path / "isolation.json"
    assert isolation.run(parser.parse_args(["--quick", "--out", str(out)])) == 0
    text = capsys.readouterr().out
    assert "CPU: " in text
    assert "(none: the observer alone)" in text
    assert "all PASS" in text
    result = json.loads(out.read_text())
    assert result["before"]["epochs_per_s"] > 0
    attacks = result["attacks"]
    assert [a["attack"] for a in attacks] == list(isolation.QUICK)
    for attack in attacks:
        assert harness.passed(attack), attack
        assert attack["epochs"] >= harness.EPOCHS_AFTER
        assert 0 < attack["peak_rss_mib"] < harness.RSS_LIMIT_MIB
    assert BENCHMARKS["isolation"] == "benchmarks.isolation"
