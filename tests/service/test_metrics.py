"""Prometheus metrics: ``tabloader status --prometheus`` and ``tabloader serve --metrics-port``.

The text is read back with ``prometheus_client``'s own parser (the format's reference
implementation), from a made-up service's figures and from a running service with a job of two
data-parallel ranks that sleep between batches (so they both wait and compute).
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tabloader import catalog
from tabloader.catalog._errors import ServiceError
from tabloader.cli import main
from tabloader.service._client import RemoteLoader
from tabloader.service._metrics import METRICS, MetricsServer, escape, render_metrics

parser = pytest.importorskip("prometheus_client.parser")

TIMEOUT = 60
ROOT = Path(__file__).resolve().parents[2]


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``name`` (a counter's with its ``_total``) by their sorted labels."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in parser.text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def rank(job: str, r: int, *, wait: float, compute: float, rows: int) -> dict[str, object]:
    return {
        "job": job,
        "rank": r,
        "world_size": 2,
        "batches": rows // 4,
        "rows": rows,
        "epoch": 0,
        "skipped": 0,
        "shared": 3,
        "wait_s": wait,
        "compute_s": compute,
        "augment_s": 0.0,
    }


STATS = {
    "clients": [{"pid": 1, "connections": 2, "jobs": []}],
    "jobs": {
        'cnn "big"\\v2\n': {  # a job name that needs every escape
            "dataset": "imgs",
            **rank("x", 0, wait=3.0, compute=1.0, rows=12),
            "ranks": [
                rank("x", 0, wait=1.0, compute=1.0, rows=8),
                rank("x", 1, wait=2.0, compute=0.0, rows=4),
            ],
        },
        "vit": {"dataset": "imgs", **rank("vit", 0, wait=0.0, compute=0.0, rows=0)},
    },
    "datasets": {
        "imgs": {
            "reads": 5,
            "decodes": 4,
            "bytes_read": 1000,
            "read_s": 0.5,
            "decode_s": 1.5,
            "collate_s": 0.25,
            "augment_s": 0.125,
        }
    },
    "cache": {
        "capacity_bytes": 1 << 20,
        "size_bytes": 4096,
        "entries": 4,
        "pinned": 1,
        "hits": 7,
        "misses": 4,
        "evictions": 2,
    },
}


def test_the_text_parses_with_help_and_type_and_escaped_labels():
    text = render_metrics(STATS)
    found = families(text)
    for metric in METRICS:
        family = metric.name.removesuffix("_total")  # the parser names a counter without it
        assert found[family].type == metric.type, metric.name
        assert found[family].documentation == metric.help
        assert f"# TYPE {metric.name} {metric.type}" in text
    job = 'cnn "big"\\v2\n'
    assert samples(text, "tabloader_job_stall_fraction") == {
        (("dataset", "imgs"), ("job", job)): 0.75,
        (("dataset", "imgs"), ("job", "vit")): 0.0,  # no time yet: no stall
    }
    assert samples(text, "tabloader_rank_stall_fraction") == {
        (("dataset", "imgs"), ("job", job), ("rank", "0")): 0.5,
        (("dataset", "imgs"), ("job", job), ("rank", "1")): 1.0,
        (("dataset", "imgs"), ("job", "vit"), ("rank", "0")): 0.0,
    }
    assert (
        samples(text, "tabloader_rank_rows_total")[
            (("dataset", "imgs"), ("job", job), ("rank", "1"))
        ]
        == 4
    )
    stages = samples(text, "tabloader_stage_seconds_total")
    assert stages[(("dataset", "imgs"), ("stage", "augment"))] == 0.125
    assert samples(text, "tabloader_cache_evictions_total") == {(): 2}
    assert samples(text, "tabloader_storage_read_bytes_total") == {(("dataset", "imgs"),): 1000}
    assert escape('a"\\\n') == 'a\\"\\\\\\n'


def test_no_service_is_one_gauge_at_zero():
    assert samples(render_metrics(None), "tabloader_service_up") == {(): 0}


def test_every_metric_is_in_the_docs_with_its_type_and_labels():
    docs = (ROOT / "docs" / "metrics.md").read_text()
    for metric in METRICS:
        line = next((ln for ln in docs.splitlines() if f"`{metric.name}`" in ln), None)
        assert line is not None, f"{metric.name} is not in docs/metrics.md"
        assert metric.type in line, metric.name
        for label in metric.labels:
            assert f"`{label}`" in line, (metric.name, label)


def test_a_taken_port_is_refused_naming_the_fix():
    server = MetricsServer(0, lambda: "x 1\n")
    try:
        with pytest.raises(ServiceError, match=r"another --metrics-port \(0: any free port\)"):
            MetricsServer(server.port, lambda: "")
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
        assert body.read() == b"x 1\n"
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=10)
    finally:
        server.close()


@pytest.fixture
def serving(image_cat_dir):
    """``tabloader serve --metrics-port 0`` on a catalog with job ``a``; (root, port)."""
    root = image_cat_dir
    with catalog.open_catalog(root) as cat:
        cat.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 16)")
    err = root.parent / "serve.err"
    with open(err, "wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tabloader", "--catalog", str(root), "serve"),
                *("--workers", "1", "--cache-bytes", str(16 << 20), "--metrics-port", "0"),
            ],
            stderr=out,
        )
    try:
        deadline = time.monotonic() + TIMEOUT
        while (port := re.search(r"127\.0\.0\.1:(\d+)/metrics", err.read_text())) is None:
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        yield root, int(port.group(1))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


def read_ranks(
    root: Path, scraped: threading.Event, errors: list[BaseException]
) -> list[threading.Thread]:
    """Rank 0 and rank 1 of job ``a``, each 4 batches 20 ms apart, open until ``scraped``."""
    taken = threading.Barrier(3)

    def one(r: int) -> None:
        try:
            with RemoteLoader(root, start=False) as remote:
                stream = remote.open("a", rank=r, world_size=2, batch_size=4)
                try:
                    for _ in range(4):
                        stream.take(None)
                        time.sleep(0.02)
                    stream.take(None)  # sends the last step's time
                    taken.wait(TIMEOUT)
                    assert scraped.wait(TIMEOUT)
                finally:
                    stream.close()
        except BaseException as exc:
            errors.append(exc)
            taken.abort()

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    taken.wait(TIMEOUT)
    return threads


def test_the_service_serves_per_job_and_per_rank_stalls_on_loopback(serving, capsys):
    root, port = serving
    scraped, errors = threading.Event(), []
    threads = read_ranks(root, scraped, errors)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = reply.read().decode()
        assert main(["--catalog", str(root), "status", "--prometheus"]) == 0
        status = capsys.readouterr().out
    finally:
        scraped.set()
        for t in threads:
            t.join(TIMEOUT)
    assert not errors, errors
    for got in (text, status):
        job = samples(got, "tabloader_job_stall_fraction")[(("dataset", "imgs"), ("job", "a"))]
        ranks = samples(got, "tabloader_rank_stall_fraction")
        assert sorted(ranks) == [
            (("dataset", "imgs"), ("job", "a"), ("rank", r)) for r in ("0", "1")
        ]
        waits = samples(got, "tabloader_rank_wait_seconds_total")
        computes = samples(got, "tabloader_rank_compute_seconds_total")
        for key, stall in ranks.items():
            assert 0 < stall < 1, (key, stall)  # both waited (the first batch) and computed
            assert computes[key] >= 3 * 0.02 * 0.9  # its 3 sleeps between batches, sent
            assert math.isclose(stall, waits[key] / (waits[key] + computes[key]))
        total_wait, total_compute = sum(waits.values()), sum(computes.values())
        assert math.isclose(job, total_wait / (total_wait + total_compute), rel_tol=1e-9)
        rows = samples(got, "tabloader_rank_rows_total")
        assert (
            sum(rows.values())
            == samples(got, "tabloader_job_rows_total")[(("dataset", "imgs"), ("job", "a"))]
        )
        assert samples(got, "tabloader_service_up") == {(): 1}
        assert samples(got, "tabloader_decodes_total")[(("dataset", "imgs"),)] > 0


def test_status_prometheus_without_a_service_says_it_is_down(capsys, image_cat_dir):
    assert main(["--catalog", str(image_cat_dir), "status", "--prometheus"]) == 0
    assert samples(capsys.readouterr().out, "tabloader_service_up") == {(): 0}


def test_metrics_port_is_checked_like_every_setting(capsys, tmp_path):
    assert main(["--catalog", str(tmp_path / "cat"), "serve", "--metrics-port", "70000"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"--metrics-port '70000' is above the range: .* e\.g\. 9464", err), err
