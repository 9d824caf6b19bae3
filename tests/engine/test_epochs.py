"""Epochs as a DataLoader has them: each ``iter()`` a new epoch (a part-read one given up and
counted), but the first after ``load_state_dict()``; ``len()``; ``state_dict(unused=)``;
``JobLoader`` for framework checkpoints; a state saved with N ranks resumed with M."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.utils.data import DataLoader

from tabloader import catalog
from tabloader.catalog import LoaderError
from tabloader.catalog._errors import ServiceError
from tabloader.engine import Loader
from tabloader.service._client import RemoteLoader
from tabloader.torch import JobDataset, JobLoader

TIMEOUT = 60


@pytest.fixture
def loader(image_cat_dir):
    cat = catalog.open_catalog(image_cat_dir)
    cat.sql(
        "REGISTER JOB j SELECT image, label FROM imgs WHERE label < 3 "
        "WITH (batch_size = 4, image_size = 16, seed = 3)"
    )
    with Loader(cat, cache_bytes=8 << 20, workers=2) as engine:
        yield engine
    cat.close()


def ids(batches) -> list[int]:
    return [i for b in batches for i in b["_id"].tolist()]


def job_rows(loader) -> list[int]:
    return sorted(loader.catalog.job("j").ids)


def test_a_new_iteration_gives_up_the_part_read_epoch_and_reads_a_whole_one(loader):
    data = JobDataset("j", loader=loader)
    rows = job_rows(loader)
    first = next(iter(DataLoader(data, batch_size=None)))  # one batch of epoch 0
    assert len(first["_id"]) == 4
    epoch = ids(DataLoader(data, batch_size=None))  # epoch 1, whole
    assert sorted(epoch) == rows
    assert data.stats()["abandoned_rows"] == len(rows) - 4
    assert data.epoch == 2
    assert sorted(ids(data)) == rows  # and the next is whole too, nothing given up
    assert data.stats()["abandoned_rows"] == len(rows) - 4
    data.close()


def test_a_limited_epoch_each_time_like_limit_train_batches(loader):
    data = JobDataset("j", loader=loader)
    rows = job_rows(loader)
    for epoch in range(4):
        it = iter(data)
        taken = [next(it) for _ in range(2)]
        assert len(ids(taken)) == 8
        assert data.epoch == epoch  # each iteration began a new epoch
    assert data.stats()["abandoned_rows"] == 3 * (len(rows) - 8)
    data.close()


def test_the_first_iteration_after_load_state_dict_resumes_mid_epoch(loader):
    data = JobDataset("j", loader=loader)
    rows = job_rows(loader)
    it = iter(data)
    seen = ids([next(it), next(it)])
    state = data.state_dict()
    assert data.state_dict()["stream"] == state["stream"]  # asking twice changes nothing
    again = JobDataset("j", loader=loader)
    data.close()
    again.load_state_dict(state)
    assert again.state_dict()["stream"] == state["stream"]  # loaded, not opened yet
    rest = ids(again)
    assert sorted(seen + rest) == rows  # each row of the epoch once
    assert sorted(ids(again)) == rows  # the next iteration is the next epoch, whole
    assert again.stats()["abandoned_rows"] == 0
    again.close()


def test_unused_batches_count_as_still_to_come(loader):
    data = JobDataset("j", loader=loader)
    rows = job_rows(loader)
    it = iter(data)
    trained = ids([next(it)])
    next(it)  # fetched ahead, as a framework may: not trained on
    state = data.state_dict(unused=1)
    data.close()
    again = JobDataset("j", loader=loader)
    again.load_state_dict(state)
    rest = ids(again)
    assert sorted(trained + rest) == rows
    again.close()
    with pytest.raises(LoaderError, match=r"3 batches taken but not trained on: .* 0 to 2"):
        JobDataset("j", loader=loader).state_dict(unused=3)


def test_len_is_the_batches_of_an_epoch_of_this_rank(loader):
    rows = len(job_rows(loader))
    data = JobDataset("j", loader=loader)
    assert len(data) == -(-rows // 4) == len(list(data))
    assert len(DataLoader(data, batch_size=None)) == len(data)
    data.close()
    assert len(JobDataset("j", loader=loader, batch_size=5)) == -(-rows // 5)
    ranked = JobDataset("j", loader=loader, rank=1, world_size=2)
    assert len(ranked) == rows // 8  # full batches of 4 for each of 2 ranks, the rest dropped
    assert (ranked.rank, ranked.world_size) == (1, 2)


def test_rank_and_world_size_come_from_the_launcher_without_opening(loader, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = JobDataset("j", loader=loader)
    assert (data.rank, data.world_size) == (1, 2)
    assert loader.stats()["jobs"] == {}  # nothing opened: rank 0 never came
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(LoaderError, match="rank is unclear: .*Seen: RANK=1; WORLD_SIZE=x"):
        len(data)  # len() finds the ranks as open would


def test_job_loader_carries_the_state_and_refuses_batching_arguments(loader):
    data = JobDataset("j", loader=loader)
    rows = job_rows(loader)
    dl = JobLoader(data)
    assert len(dl) == len(data)
    it = iter(dl)
    seen = ids([next(it)])
    state = dl.state_dict()
    data.close()
    other = JobLoader(JobDataset("j", loader=loader))
    other.load_state_dict(state)
    assert sorted(seen + ids(other)) == rows
    other.dataset.close()
    with pytest.raises(LoaderError, match=r"JobLoader\(batch_size, num_workers=...\).*job option"):
        JobLoader(JobDataset("j", loader=loader), batch_size=8, num_workers=2)
    with pytest.raises(TypeError, match="JobLoader takes a JobDataset, not list"):
        JobLoader([1, 2])


def in_threads(*fns):
    """Run each of ``fns`` in a thread (ranks of one job wait for each other); their results."""
    results: list = [None] * len(fns)
    errors: list[BaseException] = []

    def run(k, fn):
        try:
            results[k] = fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k, fn)) for k, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def test_ranks_give_up_their_own_share_and_the_next_epoch_is_whole(loader):
    rows = job_rows(loader)
    share = len(rows) // 8 * 4  # per rank, batches of 4 for 2 ranks
    ranks = [JobDataset("j", loader=loader, rank=r, world_size=2) for r in (0, 1)]

    def rank(data):
        it = iter(data)
        next(it)  # a batch of epoch 0, then a new iteration
        return ids(data)

    epochs = in_threads(*(lambda d=d: rank(d) for d in ranks))
    assert all(len(e) == share for e in epochs)
    both = epochs[0] + epochs[1]
    assert len(set(both)) == len(both) == 2 * share  # epoch 1: disjoint shares
    assert set(both) <= set(rows)
    assert all(d.stats()["abandoned_rows"] == share - 4 for d in ranks)
    for d in ranks:
        d.close()


def test_a_state_saved_with_two_ranks_resumes_with_one(loader):
    rows = job_rows(loader)
    ranks = [JobDataset("j", loader=loader, rank=r, world_size=2) for r in (0, 1)]

    def rank(data):
        it = iter(data)
        seen = ids([next(it)])
        return seen, data.state_dict()

    (seen0, state0), (seen1, state1) = in_threads(*(lambda d=d: rank(d) for d in ranks))
    assert state0["stream"] == state1["stream"]  # saved at the same step: the same state
    for d in ranks:
        d.close()
    one = JobDataset("j", loader=loader)
    one.load_state_dict(state0)
    rest = ids(one)
    assert sorted(seen0 + seen1 + rest) == rows  # the epoch's other rows, each once
    one.close()


@pytest.fixture
def served(image_cat_dir, short_tmp, monkeypatch):
    """The catalog (with job ``j``) served by a ``tabloader serve`` child; its job rows."""
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    with catalog.open_catalog(image_cat_dir) as cat:
        cat.sql(
            "REGISTER JOB j SELECT image, label FROM imgs WHERE label < 3 "
            "WITH (batch_size = 4, image_size = 16)"
        )
        rows = sorted(cat.job("j").ids)
    command = [sys.executable, "-m", "tabloader", "--catalog", str(image_cat_dir), "serve"]
    proc = subprocess.Popen([*command, "--workers", "2", "--cache-bytes", str(16 << 20)])
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                RemoteLoader(image_cat_dir, start=False).close()
                break
            except ServiceError:
                assert proc.poll() is None, "the service exited"
                assert time.monotonic() < deadline, "the service did not answer"
                time.sleep(0.05)
        yield rows
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


def test_through_the_service_a_new_iteration_gives_up_the_rest_and_releases_it(
    image_cat_dir, served
):
    rows = served
    remote = RemoteLoader(image_cat_dir, start=False)
    try:
        data = JobDataset("j", loader=remote)
        assert len(data) == -(-len(rows) // 4)
        it = iter(data)
        next(it)
        next(it)  # and one more is read ahead by the client
        assert sorted(ids(data)) == rows  # the next epoch, whole
        assert data.stats()["abandoned_rows"] == len(rows) - 8
        it = iter(data)
        seen = ids([next(it)])
        state = data.state_dict()
        data.close()
        again = JobDataset("j", loader=remote)
        again.load_state_dict(state)
        assert sorted(seen + ids(again)) == rows
        again.close()
        assert remote.stats()["cache"]["pinned"] == 0  # what was given up is released
    finally:
        remote.close()
