"""``drop_last = false``: data-parallel evaluation jobs deliver every row of each epoch, the
ranks' shares padded to one size as ``DistributedSampler(drop_last=False)`` pads them."""

from __future__ import annotations

from collections import Counter

import pytest

from tabloader.catalog import LoaderError, OptionError
from tabloader.engine import Loader
from tabloader.engine._queue.ranks import rank_share
from tabloader.engine._queue.sources import Fed
from tabloader.service._client import RemoteLoader
from tests.support.service import TIMEOUT, sql, start_service
from tests.support.threads import run_threads


def read_epochs(streams, epochs: int) -> list[list[list[list[int]]]]:
    """Every stream (a rank) on its own thread -> [rank][epoch] = the ids of each batch."""
    seen: list[list[list[list[int]]]] = [[] for _ in streams]

    def read(stream, out) -> None:
        for epoch in range(epochs):
            assert stream.epoch == epoch
            out.append([b["_id"].tolist() for b in stream.iter_epoch()])

    run_threads([lambda s=s, o=o: read(s, o) for s, o in zip(streams, seen, strict=True)])
    return seen


def check_padded_epoch(per_rank: list[list[list[int]]], rows: set[int], batch_size: int) -> None:
    """One padded epoch: each rank ceil(n / world_size) rows in full batches but its last,
    every row delivered, and the padding (fewer than world_size rows) the epoch's first rows
    (in the order dealt: batch k to rank k % world_size) repeated in turn."""
    world_size, n = len(per_rank), len(rows)
    share = -(-n // world_size)
    sizes = [batch_size] * (share // batch_size) + (
        [share % batch_size] if share % batch_size else []
    )
    for batches in per_rank:
        assert [len(b) for b in batches] == sizes
    dealt = [i for turn in zip(*per_rank, strict=True) for batch in turn for i in batch]
    first = dealt[: min(world_size, n)]
    padding = [first[i % len(first)] for i in range(share * world_size - n)]
    assert len(padding) < world_size
    assert Counter(dealt) == Counter(rows) + Counter(padding)  # nothing dropped


@pytest.mark.parametrize(
    ("rows", "batch_size", "world_size"), [(10, 3, 2), (11, 3, 2), (5, 2, 4), (5, 1, 4), (2, 4, 2)]
)
def test_every_row_is_delivered_and_the_shares_are_padded(images, rows, batch_size, world_size):
    """(5, 2, 4) and (5, 1, 4): some ranks' last batches are padding only; (2, 4, 2): a row
    a rank (a job has at most one rank per row: test_isolation)."""
    images.sql(f"REGISTER JOB j SELECT label FROM imgs WHERE _id < {rows} WITH (drop_last = false)")
    ids = set(images.job("j").ids)
    assert len(ids) == rows
    epochs = 3
    with Loader(images, cache_bytes=1 << 20) as loader:
        streams = [
            loader.open("j", batch_size=batch_size, rank=r, world_size=world_size, epochs=epochs)
            for r in range(world_size)
        ]
        seen = read_epochs(streams, epochs)
        for s in streams:
            assert s.epoch == epochs
            s.close()
    for epoch in range(epochs):
        check_padded_epoch([seen[r][epoch] for r in range(world_size)], ids, batch_size)


def test_padded_batches_of_decoded_images_leave_no_uses_or_pins(images):
    """The repeated rows are decoded (or looked up) like any other; once the job closes the
    arena's eviction inputs and pins are back to nothing."""
    images.sql(
        "REGISTER JOB j SELECT image FROM imgs WHERE _id < 11 "
        "WITH (image_size = 8, drop_last = false)"
    )
    ids = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        streams = [loader.open("j", batch_size=4, rank=r, world_size=3, epochs=2) for r in range(3)]
        seen = read_epochs(streams, 2)
        for s in streams:
            s.close()
        group = loader.scheduler("imgs")
        assert all(not counts.any() for counts in group.queues.future.uses.values())
        assert loader.stats()["cache"].pinned == 0
    for epoch in range(2):
        check_padded_epoch([seen[r][epoch] for r in range(3)], ids, 4)


def test_ten_and_eleven_rows_over_two_ranks(images):
    """The cases of the issue: 10 rows -> [3, 2] per rank and no repeat; 11 -> [3, 3] and
    exactly one repeated row."""
    images.sql("REGISTER JOB ten SELECT label FROM imgs WHERE _id < 10 WITH (drop_last = false)")
    images.sql("REGISTER JOB eleven SELECT label FROM imgs WHERE _id < 11")
    with Loader(images, cache_bytes=1 << 20) as loader:
        cases = (("ten", {}, [3, 2], 0), ("eleven", {"drop_last": False}, [3, 3], 1))
        for job, extra, sizes, repeats in cases:  # eleven: drop_last given at the open
            streams = [
                loader.open(job, batch_size=3, rank=r, world_size=2, epochs=2, **extra)
                for r in range(2)
            ]
            seen = read_epochs(streams, 2)
            for s in streams:
                s.close()
            for epoch in range(2):
                assert [[len(b) for b in seen[r][epoch]] for r in range(2)] == [sizes, sizes]
                ids = [i for r in range(2) for b in seen[r][epoch] for i in b]
                assert set(ids) == set(images.job(job).ids)
                assert len(ids) - len(set(ids)) == repeats


def test_by_default_the_remainder_is_dropped_and_one_rank_never_pads(images):
    images.sql("REGISTER JOB j SELECT label FROM imgs WHERE _id < 11")
    with Loader(images, cache_bytes=1 << 20) as loader:
        streams = [loader.open("j", batch_size=3, rank=r, world_size=2, epochs=1) for r in (0, 1)]
        seen = read_epochs(streams, 1)
        for s in streams:
            s.close()
        assert [[len(b) for b in seen[r][0]] for r in (0, 1)] == [[3], [3]]  # 5 dropped
        with loader.open("j", batch_size=3, epochs=1, drop_last=False) as one:
            batches = [b["_id"].tolist() for b in one]
    assert [len(b) for b in batches] == [3, 3, 3, 2]
    assert sorted(i for b in batches for i in b) == sorted(images.job("j").ids)


@pytest.mark.parametrize(("rows", "taken"), [(11, 1), (23, 1), (23, 3)])
def test_a_resumed_padded_epoch_delivers_every_remaining_row(images, rows, taken):
    """A state saved mid-epoch: the resumed epoch (its own padding) delivers every row not
    delivered before the save, and the rows delivered before it only as padding."""
    images.sql(f"REGISTER JOB j SELECT label FROM imgs WHERE _id < {rows} WITH (drop_last = false)")
    ids = set(images.job("j").ids)
    opts = {"batch_size": 3, "world_size": 2, "epochs": 2, "prefetch": 1}
    with Loader(images, cache_bytes=1 << 20, seed=5) as loader:
        streams = [loader.open("j", rank=r, **opts) for r in (0, 1)]
        before: set[int] = set()
        for _ in range(taken):
            for s in streams:
                before.update(s.next_batch()["_id"].tolist())
        state = streams[0].state_dict()
        assert state == streams[1].state_dict()  # saved at the same step
        for s in streams:
            s.close()
        assert state["epoch"] == 0
        streams = [loader.open("j", rank=r, state=state, **opts) for r in (0, 1)]
        seen = read_epochs(streams, 2)
        for s in streams:
            s.close()
    after = [i for r in (0, 1) for b in seen[r][0] for i in b]
    remaining = ids - before
    assert remaining <= set(after)  # every remaining row, nothing lost
    share = -(-len(remaining) // 2)
    assert len(after) == 2 * share  # the resumed epoch: the remaining rows, padded
    assert Counter(after).most_common(1)[0][1] <= 2
    check_padded_epoch([seen[r][1] for r in (0, 1)], ids, 3)  # the next epoch: all rows


def test_rank_share_with_and_without_drop_last():
    assert rank_share(11, 3, 2) == 3  # a full batch each, 5 rows dropped
    assert rank_share(11, 3, 2, drop_last=False) == 6
    assert rank_share(10, 3, 2, drop_last=False) == 5
    assert rank_share(5, 2, 4, drop_last=False) == 2
    assert rank_share(11, 3, 1, drop_last=False) == rank_share(11, 3, 1) == 11


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("maybe", r"drop_last = 'maybe' is not TRUE or FALSE.*WITH \(drop_last = FALSE\)"),
        (0, r"drop_last = 0 is not TRUE or FALSE"),
    ],
)
def test_bad_drop_last(images, value, message):
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader, pytest.raises(OptionError, match=message):
        loader.open("j", drop_last=value)
    with pytest.raises(OptionError, match=message):
        images.sql(f"REGISTER JOB k SELECT label FROM imgs WITH (drop_last = {value!r})")


def test_drop_last_is_stored_as_a_bool_from_sql_and_text(images):
    images.sql("REGISTER JOB a SELECT label FROM imgs WITH (drop_last = FALSE)")
    images.sql("REGISTER JOB b SELECT label FROM imgs WITH (drop_last = 'True')")
    assert images.job("a").options["drop_last"] is False
    assert images.job("b").options["drop_last"] is True


def test_ranks_must_agree_on_drop_last(images):
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        r0 = loader.open("j", batch_size=4, rank=0, world_size=2, drop_last=False)
        with pytest.raises(LoaderError, match=r"drop_last=True \(rank 0's: False\)"):
            loader.open("j", batch_size=4, rank=1, world_size=2)
        r0.close()


def test_a_padded_job_through_the_service(cat_dir):
    """11 rows over 2 ranks in batches of 4, padded, through the service: every row, one
    repeated."""
    proc = start_service(cat_dir)
    try:
        with RemoteLoader(cat_dir, start=False) as remote:
            sql(remote, "REGISTER JOB p SELECT label FROM imgs WHERE _id < 11")
            streams = [
                remote.open("p", batch_size=4, rank=r, world_size=2, epochs=1, drop_last=False)
                for r in (0, 1)
            ]
            seen = read_epochs(streams, 1)
            for s in streams:
                s.close()
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)
    assert [[len(b) for b in seen[r][0]] for r in (0, 1)] == [[4, 2], [4, 2]]
    check_padded_epoch([seen[r][0] for r in (0, 1)], set(range(11)), 4)


def test_a_cluster_node_refuses_padding(images):
    """A Ray cluster's leader places rows with drop_last = true: a node's padded rank would
    wait for rows that never come."""
    images.sql("REGISTER JOB j SELECT label FROM imgs WITH (drop_last = false)")
    with (
        Loader(images, cache_bytes=1 << 20) as loader,
        pytest.raises(LoaderError, match=r"drop_last = false .* not supported on a Ray cluster"),
    ):
        loader.serve(images.job("j"), source=Fed, batch_size=4, rank=0, world_size=2)


def test_the_length_of_a_job_dataset_counts_the_padded_batches(images):
    pytest.importorskip("torch")
    from tabloader.torch import JobDataset

    images.sql("REGISTER JOB j SELECT label FROM imgs WHERE _id < 11 WITH (batch_size = 3)")
    with Loader(images, cache_bytes=1 << 20) as loader:
        kept = JobDataset("j", loader=loader, rank=1, world_size=2, drop_last=False)
        dropped = JobDataset("j", loader=loader, rank=1, world_size=2)
        assert (len(kept), len(dropped)) == (2, 1)  # [3, 3] with padding; [3], 5 rows dropped
