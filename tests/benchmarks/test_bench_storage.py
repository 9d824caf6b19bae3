"""``python -m benchmarks storage`` in its quick form: the loopback S3 server with latency, the
DataLoader and tabloader arms side by side (LitData: the slow test). Counts only (requests
and bytes per epoch), never a timing."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import BENCHMARKS, storage
from tabloader.engine._arena.shm import shm_available

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")


@pytest.fixture(autouse=True)
def fresh_stores():
    """Each run's S3 server has a port of its own: no store of this process may keep one."""
    from tabloader.catalog.storage._s3 import forget_stores

    forget_stores()
    yield
    forget_stores()


def quick(tmp_path, capsys, arms: str) -> tuple[str, dict]:
    parser = argparse.ArgumentParser()
    storage.add_arguments(parser)
    out = tmp_path / "storage.json"
    args = parser.parse_args(["--quick", "--arms", arms, "--out", str(out)])
    assert storage.run(args) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_quick_run_counts_each_arms_requests_and_bytes_per_epoch(tmp_path, capsys):
    text, data = quick(tmp_path, capsys, "dataloader,tabloader")
    assert "CPU: " in text
    assert "SIMD: " in text
    assert "10 ms added a request" in text
    assert f"4 jobs' tier {data['tier_bytes']:,} bytes" in text
    results, images, size = data["results"], data["images"], data["dataset_bytes"]
    assert "LitData S3" not in results  # not asked for
    expected = {
        "DataLoader(2) S3",
        "DataLoader(2) local",
        "tabloader 1 job S3",
        "tabloader 1 job local",
        "tabloader 4 jobs S3",
        "tabloader 4 jobs local",
    }
    assert set(results) == expected
    for name in expected:
        assert [ep["rows"] for ep in results[name]] == [images * (4 if "4 jobs" in name else 1)] * 2
    for ep in results["DataLoader(2) S3"]:  # an object, a GET, each image each epoch
        assert ep["gets"] == images
        assert ep["bytes"] == size
    for name in ("DataLoader(2) local", "tabloader 1 job local", "tabloader 4 jobs local"):
        assert all(ep["gets"] == ep["bytes"] == 0 for ep in results[name]), name
    first = results["tabloader 1 job S3"][0]  # the whole dataset, in ranged reads
    assert first["bytes"] >= data["stored_bytes"] * 0.9
    assert 0 < first["gets"] < images
    four = results["tabloader 4 jobs S3"]  # the four jobs share one fetch, and the tier
    assert sum(ep["bytes"] for ep in four) <= 1.15 * data["stored_bytes"]
    assert [c["check"] for c in data["checks"]] == [
        "tabloader 1 job S3 / local (tier off)",
        "tabloader 4 jobs, 2 epochs: fetched / stored",
    ]
    assert data["checks"][1]["result"] == "PASS"
    assert BENCHMARKS["storage"] == "benchmarks.storage"


@pytest.mark.slow  # LitData's optimize and two more processes importing torch
def test_quick_run_with_litdata_reads_its_chunks_from_the_bucket(tmp_path, capsys):
    pytest.importorskip("litdata")
    _, data = quick(tmp_path, capsys, "litdata")
    s3, local = data["results"]["LitData S3"], data["results"]["LitData local"]
    assert [ep["rows"] for ep in s3] == [ep["rows"] for ep in local] == [data["images"]] * 2
    assert s3[0]["gets"] > 0
    assert s3[0]["bytes"] >= data["dataset_bytes"]  # its chunks hold every image


def test_unknown_arms_are_named():
    parser = argparse.ArgumentParser()
    storage.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--arms", "dataloader,webdataset"])
    with pytest.raises(argparse.ArgumentTypeError, match="unknown arm.*webdataset: use some of"):
        storage._arms_option("webdataset")
