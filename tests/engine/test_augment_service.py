"""Augmented jobs through the loader service: the service augments in its own pool, and a
row's batch is the same across a service restart and a resume."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from test_augment_bounds import BAD

from tabloader import catalog
from tabloader.catalog._augment import default_seed
from tabloader.catalog._errors import OptionError
from tabloader.engine._prepare.augment import Augmenter
from tabloader.engine.decode import Fit, decode_image
from tabloader.service._client import RemoteLoader
from tests.support.service import TIMEOUT, start_service

TRAIN = "RandomResizedCrop(20, scale=(0.2, 1.0)), RandomHorizontalFlip(), Normalize(0.5, 0.5)"


@pytest.fixture
def aug_dir(image_cat_dir):
    root = image_cat_dir
    with catalog.open_catalog(root) as cat:
        cat.sql(f"REGISTER JOB tr SELECT image, label FROM imgs WITH (augment = '{TRAIN}')")
        cat.sql("REGISTER JOB ev SELECT image FROM imgs WHERE label < 2 WITH (image_size = 20)")
        ds = cat.dataset("imgs")
        raw = ds.take(list(range(ds.num_rows)), ["image"]).column("image").to_pylist()
    return root, raw


def stop(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(TIMEOUT)


def read(remote, job, **kw):
    out = {}
    with remote.open(job, batch_size=8, **kw) as s:
        for _ in range(kw.get("epochs", 2)):
            e = s.epoch
            for b in s.iter_epoch():
                for i, img in zip(b["_id"].tolist(), b["image"], strict=True):
                    out[(e, i)] = img.copy()
    return out


def test_augmented_batches_survive_a_service_restart_and_a_resume(aug_dir):
    root, raw = aug_dir
    proc = start_service(root)
    try:
        with RemoteLoader(root, start=False) as remote:
            first = read(remote, "tr", epochs=2)
            with remote.open("tr", batch_size=8):  # open beside it, ev reads its decode
                ev = read(remote, "ev", epochs=1)
            for text, match in BAD:  # refused as REGISTER and Loader.open refuse it
                with pytest.raises(OptionError, match=match):
                    remote.open("tr", augment=text)
            stats = remote.stats()
            with remote.open("tr", batch_size=8, epochs=2) as s:
                head = [(0, s.take()), (0, s.take())]
                state = s.state_dict()
                # the job's own augmentation (the service's pool) is counted apart from waiting
                assert s.stats()["augment_s"] > 0
                (seen,) = [j for j in remote.stats()["jobs"].values() if j["job"] == "tr"]
                assert seen["augment_s"] > 0
    finally:
        stop(proc, signal.SIGKILL)  # the service dies; a new one serves the rest
    proc = start_service(root)
    try:
        with RemoteLoader(root, start=False) as remote:
            rest = read(remote, "tr", epochs=2, state=state)
    finally:
        stop(proc)
    assert stats["decodes"] == len(raw)  # the evaluation job read the open training job's
    assert all(v.shape == (20, 20, 3) and v.dtype == np.uint8 for v in ev.values())
    # the reference: the job's augmentation of the shared decode, computed here
    aug = Augmenter(TRAIN, seed=default_seed("tr"))
    for (e, r), img in first.items():
        want = np.empty(aug.output_shape, aug.dtype)
        aug.apply(decode_image(raw[r], size=Fit(20)), e, r, want)
        assert img.shape == (3, 20, 20)
        assert (img == want).all()
    resumed = {
        (0, i): img for _, b in head for i, img in zip(b["_id"].tolist(), b["image"], strict=True)
    }
    resumed.update(rest)
    assert resumed.keys() == first.keys()
    assert all((resumed[k] == first[k]).all() for k in first)


def test_the_service_augments_into_slots_the_batch_frees_on_release(aug_dir):
    """A handed-over batch of an augmented job holds slots of its own (the job's images, made
    by the service's pool) instead of the shared decodes it came from; each goes when its
    client has copied it out, so after the epoch only the shared decodes stay cached."""
    root, raw = aug_dir
    proc = start_service(root)
    try:
        with RemoteLoader(root, start=False) as remote:
            with remote.open("tr", batch_size=8, epochs=1) as s:
                first = s.take()
                # the client has copied its batch out (its slots went); the batch read ahead is
                # prepared into slots of its own, pinned until that batch is handed and copied
                deadline = time.monotonic() + 20
                while remote.stats()["cache"]["pinned"] < len(first["_id"]):
                    assert time.monotonic() < deadline, remote.stats()["cache"]
                    time.sleep(0.02)
                rows = sum(len(b["_id"]) for b in s.iter_epoch()) + len(first["_id"])
            stats = remote.stats()
    finally:
        stop(proc)
    assert rows == len(raw)
    assert first["image"].dtype == np.float32
    assert first["image"].shape == (len(first["_id"]), 3, 20, 20)
    assert stats["cache"]["pinned"] == 0
    # the shared decodes stay (every row's, once); no slot of a batch is left behind
    assert stats["cache"]["entries"] == stats["decodes"] == len(raw)
    assert remote.copies.copied_bytes == remote.copies.prepared_bytes
