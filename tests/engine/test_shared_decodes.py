"""Jobs open together on overlapping rows share one decode of each row
(``tabloader.engine._prepare.planning``): the jobs that are open decide which decode, never the ones
registered, and a job reads another's decode only up to ``MAX_SHARED_SCALE`` times its own
need, saying so; one job's registration or decode never changes another job's cost."""

from __future__ import annotations

import logging
import random
import re
import threading

import numpy as np
import pytest
from pyroaring import BitMap

from tabloader import catalog
from tabloader.catalog._errors import LoaderError
from tabloader.engine._loader import Loader
from tabloader.engine._prepare.augment import Augmenter
from tabloader.engine._prepare.planning import MAX_SHARED_SCALE, OpenDecode, column_plan
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


def test_jobs_open_together_decode_each_row_of_their_union_once(chain):
    """The training job open first: e2 reads its decode, and e1 too, through e2's rows."""
    root, raw = chain
    order = ["tr", "e2", "e1"]
    got: dict[str, dict[int, np.ndarray]] = {name: {} for name in order}
    with Loader(root, cache_bytes=32 << 20, decode="threads") as loader:
        streams = {name: loader.open(name, batch_size=8, epochs=1) for name in order}
        threads = [
            threading.Thread(target=read_epoch, args=(streams[name], got[name])) for name in order
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        decodes = loader.stats()["decodes"]
    assert {n: len(rows) for n, rows in got.items()} == {"e1": 30, "e2": 30, "tr": 30}
    assert decodes == len(raw)  # the union: every row once, e1's label-1 rows included
    resize = Augmenter("Resize(20), CenterCrop(20)", 0)
    for r, img in got["e1"].items():
        want = np.empty((20, 20, 3), np.uint8)
        resize.apply(decode_image(raw[r], size=Fit(20)), 0, r, want)
        assert (img == want).all()


def test_a_job_open_alone_reads_its_own_values_whatever_is_registered(chain):
    """e1 and the training job one after the other: e1 decodes its own fixed-size values (it
    read the registered training job's decode, resized, whether that job ever opened or not)."""
    root, raw = chain
    with Loader(root, cache_bytes=32 << 20, decode="threads") as loader:
        got: dict[int, np.ndarray] = {}
        stream = loader.open("e1", batch_size=8, epochs=1)
        assert dict(stream.augment) == {}
        read_epoch(stream, got)
        read_epoch(loader.open("tr", batch_size=8, epochs=1), {})
    assert len(got) == 30
    assert all((img == decode_image(raw[r], size=20)).all() for r, img in got.items())


# the REGISTER: 32 rows of a 2048 (8192) decode took 512 MiB (8 GiB) at the open check
BIG = ["Resize(2048), CenterCrop(8)", "Resize(8192), CenterCrop(8)"]


@pytest.mark.parametrize("big", BIG)
def test_a_job_registered_and_never_opened_changes_no_other_jobs_cost(images, big):
    images.sql("REGISTER JOB ev SELECT image, label FROM imgs WITH (image_size = 32)")
    images.sql(f"REGISTER JOB big SELECT image FROM imgs WITH (augment = '{big}')")
    # the service's open (its batches pinned in its cache) checks the job's batch size
    with (
        Loader(images, cache_bytes=8 << 20) as loader,
        loader.serve("ev", batch_size=32) as stream,
    ):
        assert dict(stream.augment) == {}  # its own 32 x 32 values, as if big were not


@pytest.mark.parametrize("big", BIG)
def test_a_job_open_beside_a_far_larger_decode_keeps_its_own_and_the_log_says_why(
    images, big, caplog
):
    images.sql("REGISTER JOB ev SELECT image, label FROM imgs WITH (image_size = 32)")
    images.sql(f"REGISTER JOB big SELECT image FROM imgs WITH (augment = '{big}')")
    need = int(big[7:11])
    with (
        Loader(images, cache_bytes=8 << 20) as loader,
        loader.open("big", batch_size=8),
        caplog.at_level(logging.INFO, logger="tabloader.engine"),
        loader.serve("ev", batch_size=32) as stream,
    ):
        assert dict(stream.augment) == {}
    assert (
        "job 'ev' decodes column 'image' at 32 x 32 (fixed-size values) apart from open job(s) "
        f"big at shorter side {need} (a job reads a shared aspect-kept decode of 1 to "
        f"{MAX_SHARED_SCALE}x its own need, 32 here): the rows they share are decoded at both "
        "sizes while they are open together"
    ) in caplog.text


def test_a_job_reading_a_larger_shared_decode_says_so_and_its_open_check_names_it(images, caplog):
    images.sql("REGISTER JOB tr SELECT image FROM imgs WITH (augment = 'RandomResizedCrop(40)')")
    images.sql("REGISTER JOB ev SELECT image FROM imgs WITH (image_size = 24)")
    note = (
        "job 'ev' reads column 'image' from the shared decode of open job(s) tr at shorter "
        "side 40, 1.7x its own 24 (2.8x the pixels; at most 4x)"
    )
    # a cache that holds three batches of ev's own 24 x 24 values, not of 40-pixel decodes
    with Loader(images, cache_bytes=100_000) as loader:
        with loader.serve("ev", batch_size=8) as alone:
            assert dict(alone.augment) == {}
        with loader.open("tr", batch_size=8):
            with (
                caplog.at_level(logging.INFO, logger="tabloader.engine"),
                loader.open("ev", batch_size=8) as beside,
            ):
                assert beside.augment["image"].spec.text == "Resize(24), CenterCrop(24)"
            assert note in caplog.text
            with pytest.raises(
                LoaderError,
                match=r"--cache-bytes\. It reads decodes larger than it needs, shared with jobs "
                rf"open now: {re.escape(note)}\.$",
            ):
                loader.serve("ev", batch_size=8)


def test_a_job_needing_more_decodes_apart_and_names_who_may_read_it_later(images, caplog):
    """A job whose need is over the open decode's opens no larger decode for the open jobs
    (their plans are fixed): it decodes its own, and says which of them may read it when
    they open again beside it, and by how much; the one that does says so too."""
    images.sql("REGISTER JOB small SELECT image FROM imgs WITH (augment = 'RandomResizedCrop(20)')")
    images.sql("REGISTER JOB tr SELECT image FROM imgs WITH (augment = 'RandomResizedCrop(32)')")
    with Loader(images, cache_bytes=8 << 20) as loader:
        first = loader.open("small", batch_size=8)
        with caplog.at_level(logging.INFO, logger="tabloader.engine"):
            tr = loader.open("tr", batch_size=8)
        assert (
            "job 'tr' decodes column 'image' at shorter side 32 apart from open job(s) small at "
            "shorter side 20 (a job reads a shared aspect-kept decode of 1 to 2x its own need, "
            "32 here): the rows they share are decoded at both sizes while they are open "
            "together; opened again while it is open, these may read its decode instead of "
            "theirs: small (1.6x the side, 2.6x the pixels)"
        ) in caplog.text
        assert [d.image_size for d, _ in first.rank_state.job.plan.prepared] == [Fit(20)]
        first.close()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tabloader.engine"):
            again = loader.open("small", batch_size=8)
        assert [d.image_size for d, _ in again.rank_state.job.plan.prepared] == [Fit(32)]
        assert (
            "job 'small' reads column 'image' from the shared decode of open job(s) tr at "
            "shorter side 32, 1.6x its own 20 (2.6x the pixels; at most 4x)"
        ) in caplog.text
        again.close()
        tr.close()


def _decodes() -> dict[str, OpenDecode]:
    rows = BitMap(range(0, 10))
    return {
        "a": OpenDecode("a", rows, Fit(20)),
        "b": OpenDecode("b", rows, Fit(30)),
        "far": OpenDecode("far", BitMap(range(100, 110)), Fit(16)),  # meets no row
        "capped": OpenDecode("capped", rows, Fit(20, 64)),  # another decode_size
        "big": OpenDecode("big", rows, Fit(2048)),
        "ev": OpenDecode("ev", rows, 16),  # an image_size job's own values
    }


@pytest.mark.parametrize(
    ("job", "size", "augment", "want"),
    [
        ("x", 16, None, Fit(20)),  # the smallest within 16..32 that meets its rows
        ("x", 32, None, 32),  # none within 32..64: its own values
        ("x", 10, None, Fit(20)),  # 20 is 2x: the bound, included
        ("x", 9, None, 9),  # 20 is over 2x
        ("x", None, "RandomResizedCrop(20)", Fit(20)),
        ("x", None, "RandomResizedCrop(24)", Fit(30)),
        ("x", None, "RandomResizedCrop(512)", Fit(512)),  # its own need, 2048 is over 2x
        ("a", None, "RandomResizedCrop(20)", Fit(30)),  # a job's own decode is not another's
    ],
)
def test_a_job_reads_the_smallest_open_decode_that_serves_it_within_the_bound(
    job, size, augment, want
):
    decodes = list(_decodes().values())
    aug = None if augment is None else Augmenter(augment, 0)
    plans = []
    for seed in range(10):  # whatever order the jobs opened in
        random.Random(seed).shuffle(decodes)
        plans.append(column_plan(job, BitMap(range(5, 15)), "image", size, aug, None, decodes))
    seen = {(p.size, p.augmenter and p.augmenter.spec.text, p.larger, p.apart) for p in plans}
    assert len(seen) == 1
    plan = plans[0]
    assert plan.size == want
    if isinstance(want, int):
        assert plan.augmenter is None
        assert plan.larger is None
    elif augment is None:
        assert plan.augmenter.spec.text == f"Resize({size}), CenterCrop({size})"
    own = size or aug.spec.need
    if isinstance(want, Fit) and want.least > own:
        assert plan.larger.startswith(f"job '{job}' reads column 'image' from the shared decode")
        assert f"at shorter side {want.least}, {want.least / own:.2g}x its own {own}" in plan.larger
    else:
        assert plan.larger is None
    # every other decode of rows it meets is named as decoded apart; 'far' meets none
    assert "far" not in plan.apart
    assert "big at shorter side 2048" in plan.apart
    assert "capped at shorter side 20 (capped at 64)" in plan.apart
