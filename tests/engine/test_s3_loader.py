"""Training from a dataset in object storage (moto's S3 server on loopback behind our proxy,
the ``s3`` fixture): every job reads every epoch exactly once, through faults."""

from __future__ import annotations

import os
import re
import threading

import numpy as np
import pytest

from tabloader.cli import main
from tabloader.engine import Loader
from tabloader.engine._arena.shm import shm_available
from tabloader.engine.decode import decode_image
from tests.support.s3proxy import Faults


def run(loader, jobs: dict[str, int]) -> dict[str, list[list[int]]]:
    """Each job of ``jobs`` ({name: epochs}) on its own thread: its rows, epoch by epoch."""
    seen: dict[str, list[list[int]]] = {name: [] for name in jobs}
    errors: list[BaseException] = []

    def consume(name: str) -> None:
        try:
            with loader.open(name, batch_size=7, epochs=jobs[name]) as stream:
                for _ in range(jobs[name]):
                    rows = [i for b in stream.iter_epoch() for i in b["_id"].tolist()]
                    seen[name].append(rows)
        except BaseException as exc:  # raised below, with its cause (a thread's is only logged)
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(n,)) for n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return seen


def test_two_jobs_train_exactly_once_per_epoch_through_503s_and_cut_bodies(cat, s3, image_folder):
    # decode processes where there is shared memory: each reads through its own S3 store
    ds = cat.import_imagefolder("imgs", image_folder, storage=f"{s3.uri}/train")
    assert ds.reader.spec()[0] == f"{s3.uri}/train"
    cat.sql("REGISTER JOB a SELECT image, label FROM imgs WITH (image_size = 16)")
    cat.sql("REGISTER JOB b SELECT image FROM imgs WHERE label > 0 WITH (image_size = 16)")
    s3.proxy.reset()
    s3.proxy.faults = Faults(seed=7, slowdown=0.05, cut=0.01)
    decode = "processes" if shm_available() else "threads"
    with Loader(cat, cache_bytes=1 << 20, workers=2, decode=decode) as loader:
        seen = run(loader, {"a": 2, "b": 2})
    for name, epochs in seen.items():
        expected = sorted(cat.job(name).ids)
        assert len(epochs) == 2
        assert all(sorted(rows) == expected for rows in epochs), name
    assert s3.proxy.stats.gets() > 0  # read from the bucket, not from a local copy
    assert not (cat.root / "data" / "imgs").exists()


def test_the_pixels_read_from_the_bucket_are_the_images(cat, s3, image_folder):
    cat.import_imagefolder("imgs", image_folder, storage=s3.uri)
    cat.sql("REGISTER JOB j SELECT image, path FROM imgs WITH (image_size = 24)")
    with (
        Loader(cat, cache_bytes=1 << 20, workers=2, decode="threads") as loader,
        loader.open("j", batch_size=8, epochs=1) as stream,
    ):
        batch = stream.next_batch()
    for img, path in zip(batch["image"], batch["path"], strict=True):
        expected = decode_image((image_folder / path).read_bytes(), size=24)
        assert np.array_equal(img, expected)


def test_the_cli_imports_into_a_bucket_and_verifies_it(tmp_path, s3, image_folder, capsys):
    root = str(tmp_path / "cat")
    args = ["--catalog", root, "import", "imgs", str(image_folder), "--storage", s3.uri]
    assert main(args) == 0
    assert len(s3.keys("data/imgs/")) == 1
    assert main(["--catalog", root, "verify", "imgs"]) == 0
    assert "no damage found" in capsys.readouterr().out
    key = s3.keys("data/imgs/")[0]
    body = bytearray(s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    body[len(body) // 3] ^= 0xFF  # inside an image
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    assert main(["--catalog", root, "verify", "imgs"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"DAMAGED imgs: rows \d+\.\.\d+: .* 's3://", out), out


def test_decode_processes_read_with_the_credentials_of_now_not_of_their_forkserver(
    cat, s3, image_folder, monkeypatch
):
    """The decode processes come from a forkserver, started once a process with the
    environment of then: credentials set after it started (as the ``s3`` fixture of a later
    test sets them) still reach them, as they would a child started now."""
    if not shm_available():
        pytest.skip("no shared memory: no decode processes (threads read with the environment)")
    cat.import_imagefolder("local", image_folder)
    cat.sql("REGISTER JOB l SELECT image FROM local WITH (image_size = 16)")
    keys = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for key in keys:
        monkeypatch.delenv(key)
    with Loader(cat, cache_bytes=1 << 20, workers=2, decode="processes") as loader:
        assert run(loader, {"l": 1})["l"]  # the forkserver runs, started without credentials
    for key, value in keys.items():
        monkeypatch.setenv(key, value)
    cat.import_imagefolder("imgs", image_folder, storage=f"{s3.uri}/train")
    cat.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(cat, cache_bytes=1 << 20, workers=2, decode="processes") as loader:
        (epoch,) = run(loader, {"a": 1})["a"]
    assert sorted(epoch) == sorted(cat.job("a").ids)
