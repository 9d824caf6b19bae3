"""A loader service reading a dataset from the loopback S3 server through its storage tier:
``--storage-cache-bytes``, kept across a restart, shown by ``tabloader status``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from tabloader import catalog
from tabloader.catalog.storage import _writer
from tabloader.service._client import RemoteLoader
from tests.support.service import TIMEOUT, start_service


def epoch_of(root, job):
    with RemoteLoader(root, start=False) as remote, remote.open(job, batch_size=8, epochs=1) as s:
        return sorted(i for b in s.iter_epoch() for i in b["_id"].tolist())


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 0


def test_a_restarted_service_reads_its_next_epoch_from_its_tier(
    short_tmp, s3, tier_images, monkeypatch
):
    monkeypatch.setattr(_writer, "RANGED_BATCH_BYTES", 32 << 10)  # batches of a row or two
    root = short_tmp / "cat"
    with catalog.open_catalog(root, create=True) as cat:
        ds = cat.import_imagefolder("imgs", tier_images, storage=s3.uri)
        cat.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 32)")
        size = sum(p.file_size for p in ds.reader.parts)
    s3.proxy.reset()

    def fetched():
        return sum(n for k, n in s3.proxy.stats.body_bytes.items() if "/data/imgs/" in k)

    proc = start_service(root, "--storage-cache-bytes", str(2 * size))
    try:
        assert epoch_of(root, "a") == list(range(80))
        status = [sys.executable, "-m", "tabloader", "--catalog", str(root), "status"]
        text = subprocess.run(status, capture_output=True, text=True, timeout=TIMEOUT)
        raw = subprocess.run([*status, "--json"], capture_output=True, text=True, timeout=TIMEOUT)
    finally:
        stop(proc)
    first = fetched()
    assert 0.95 * size <= first <= 1.15 * size
    assert "storage: bucket " in text.stdout, text.stdout + text.stderr
    assert f"of {2 * size:,} bytes held" in text.stdout
    storage = json.loads(raw.stdout)["storage"]
    assert storage["bucket_bytes"] >= 0.95 * size
    assert storage["tier"]["capacity_bytes"] == 2 * size
    proc = start_service(root, "--storage-cache-bytes", str(2 * size))
    try:
        assert epoch_of(root, "a") == list(range(80))
    finally:
        stop(proc)
    assert fetched() - first <= 0.05 * size, (fetched() - first, size)
