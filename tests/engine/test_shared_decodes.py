"""Jobs whose rows overlap share one decode of each row, whatever order they run in: the
arena space of a job's image column follows the registered jobs (``tabloader.engine._prepare.planning``),
so a job run after another finds the rows the first decoded."""

from __future__ import annotations

import itertools
import random
import threading

import numpy as np
import pytest
from pyroaring import BitMap

from tabloader import catalog
from tabloader.engine._loader import Loader
from tabloader.engine._prepare.augment import Augmenter
from tabloader.engine._prepare.planning import _group_need, _Reader
from tabloader.engine.decode import Fit, decode_image

TRAIN = "RandomResizedCrop(20), RandomHorizontalFlip()"

# a chain: e1 meets e2 (label 1), e2 meets tr (label 2), e1 never meets tr
JOBS = {
    "e1": ("label < 2", "image_size = 20"),
    "e2": ("label IN (1, 2)", "image_size = 20"),
    "tr": ("label >= 2", f"augment = '{TRAIN}'"),
}


@pytest.fixture
def chain(image_cat_dir):
    with catalog.open_catalog(image_cat_dir) as cat:
        for name, (where, options) in JOBS.items():
            cat.sql(f"REGISTER JOB {name} SELECT image FROM imgs WHERE {where} WITH ({options})")
        ds = cat.dataset("imgs")
        raw = ds.take(list(range(ds.num_rows)), ["image"]).column("image").to_pylist()
    return image_cat_dir, raw


def read_epoch(stream, out):
    """One epoch of ``stream`` into ``out``: ``_id`` -> image; the stream is closed after."""
    with stream:
        for batch in stream.iter_epoch():
            out.update(zip(batch["_id"].tolist(), np.array(batch["image"]), strict=True))


@pytest.mark.parametrize("concurrent", [False, True], ids=["one-after-another", "at-once"])
@pytest.mark.parametrize("order", [["e1", "e2", "tr"], ["tr", "e2", "e1"]], ids="-".join)
def test_overlapping_jobs_decode_each_row_of_their_union_once(chain, order, concurrent):
    root, raw = chain
    got: dict[str, dict[int, np.ndarray]] = {name: {} for name in order}
    with Loader(root, cache_bytes=32 << 20, decode="threads") as loader:
        if concurrent:
            streams = {name: loader.open(name, batch_size=8, epochs=1) for name in order}
            threads = [
                threading.Thread(target=read_epoch, args=(streams[name], got[name]))
                for name in order
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:  # each job reads its epoch and closes before the next opens
            for name in order:
                read_epoch(loader.open(name, batch_size=8, epochs=1), got[name])
        decodes = loader.stats()["decodes"]
    assert {n: len(rows) for n, rows in got.items()} == {"e1": 30, "e2": 30, "tr": 30}
    assert decodes == len(raw)  # the union: every row once, e1's label-1 rows included
    # e1, though it meets no augmented job, reads the shared decode as e2 does, at tr's need
    resize = Augmenter("Resize(20), CenterCrop(20)", 0)
    for r, img in got["e1"].items():
        want = np.empty((20, 20, 3), np.uint8)
        resize.apply(decode_image(raw[r], size=Fit(20)), 0, r, want)
        assert (img == want).all()


def test_an_image_size_job_meeting_no_reader_of_a_shared_decode_keeps_its_fixed_values(chain):
    root, raw = chain
    with catalog.open_catalog(root) as cat:
        cat.sql("REGISTER JOB e3 SELECT image FROM imgs WHERE label < 2 WITH (image_size = 24)")
    with Loader(root, cache_bytes=32 << 20, decode="threads") as loader:
        got: dict[int, np.ndarray] = {}
        stream = loader.open("e3", batch_size=8, epochs=1)
        assert dict(stream.augment) == {}  # tr's need (20) is below its size: not a reader
        read_epoch(stream, got)
    assert all((img == decode_image(raw[r], size=24)).all() for r, img in got.items())


def test_the_groups_are_the_same_whichever_job_is_planned_and_in_whatever_order():
    """Each job's shared decode from orders of the registered jobs: a chain of
    evaluation jobs joins a training job's group, an evaluation job that meets two groups
    merges them (the one of the lower need decodes at the higher), and one whose size is
    above every need it meets keeps its own values."""
    jobs = {
        "e1": _Reader(BitMap(range(0, 10)), None, 20),  # meets e2 only
        "e2": _Reader(BitMap(range(5, 15)), None, 20),  # meets tr
        "tr": _Reader(BitMap(range(10, 20)), 20, None),
        "lo": _Reader(BitMap(range(100, 110)), 16, None),
        "ev": _Reader(BitMap(range(105, 125)), None, 16),  # meets lo and hi: merges them
        "hi": _Reader(BitMap(range(120, 130)), 32, None),
        "big": _Reader(BitMap(range(0, 30)), None, 64),  # above every need it meets
    }
    want = {"e1": 20, "e2": 20, "tr": 20, "lo": 32, "ev": 32, "hi": 32, "big": None}
    orders = list(itertools.permutations(jobs))
    for order in random.Random(0).sample(orders, 100):
        readers = [jobs[name] for name in order]
        got = {name: _group_need(readers, order.index(name)) for name in order}
        assert got == want, order
