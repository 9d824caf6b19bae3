from __future__ import annotations

import math
import multiprocessing
import os
import pickle
import re
import threading
import traceback

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from tabloader import catalog
from tabloader.catalog import LoaderError, OptionError
from tabloader.engine import Loader
from tabloader.sampling._importance import PRIOR, ImportanceScores
from tabloader.torch import JobDataset


@pytest.fixture
def loader(image_cat_dir):
    cat = catalog.open_catalog(image_cat_dir)
    cat.sql(
        "REGISTER JOB j SELECT image, label FROM imgs WHERE label < 3 "
        "WITH (batch_size = 8, image_size = 16, seed = 3)"
    )
    with Loader(cat, cache_bytes=8 << 20, workers=2) as engine:
        yield engine
    cat.close()


def epoch_ids(data) -> list[int]:
    return [i for batch in DataLoader(data, batch_size=None) for i in batch["_id"].tolist()]


def test_batches_are_dicts_of_tensors_one_epoch_per_iteration(loader):
    data = JobDataset("j", loader=loader)
    rows = sorted(loader.catalog.job("j").ids)
    batches = list(DataLoader(data, batch_size=None))
    first = batches[0]
    assert first["image"].dtype == torch.uint8
    assert first["image"].shape == (8, 16, 16, 3)
    assert first["label"].dtype == torch.int64
    assert first["_id"].dtype == torch.int64
    assert all(len(b["_id"]) <= 8 for b in batches)
    assert sorted(i for b in batches for i in b["_id"].tolist()) == rows
    second = epoch_ids(data)
    assert sorted(second) == rows
    assert second != [i for b in batches for i in b["_id"].tolist()]  # a new permutation
    data.close()


def test_job_options_pass_through_and_unknown_ones_are_refused(loader):
    with pytest.raises(OptionError, match=r"open\(imagesize=8\): .*Did you mean 'image_size'"):
        JobDataset("j", loader=loader, imagesize=8)  # refused at once, not at the first batch
    data = JobDataset("j", loader=loader, batch_size=4, image_size=(8, 6), on_error="skip")
    first = next(iter(DataLoader(data, batch_size=None)))
    assert first["image"].shape == (4, 8, 6, 3)
    expected = {"batch_size": 4, "image_size": (8, 6), "seed": 3, "on_error": "skip"}
    assert data.spec.values == expected  # REGISTER's seed, the rest given here
    data.close()


def test_resume_mid_epoch(loader):
    data = JobDataset("j", loader=loader)
    rows = sorted(loader.catalog.job("j").ids)
    it = iter(DataLoader(data, batch_size=None))
    seen = [i for _ in range(2) for i in next(it)["_id"].tolist()]
    state = data.state_dict()
    data.close()
    again = JobDataset("j", loader=loader)
    again.load_state_dict(state)
    rest = epoch_ids(again)
    assert sorted(seen + rest) == rows
    assert len(seen + rest) == len(rows)
    assert sorted(epoch_ids(again)) == rows  # the next epoch is whole
    again.close()


def test_transform_uses_the_jobs_own_generator(loader):
    def draws(seed):
        record = []

        def transform(batch, generator):
            record.append(torch.rand(1, generator=generator).item())
            batch["image"] = batch["image"].flip(2)
            return batch

        data = JobDataset("j", loader=loader, transform=transform, seed=seed)
        batch = next(iter(DataLoader(data, batch_size=None)))
        data.close()
        return record, batch

    a, batch = draws(1)
    b, _ = draws(1)
    c, _ = draws(2)
    assert a == b
    assert a != c
    assert batch["image"].shape[1:] == (16, 16, 3)


class SlowOpen:
    """A loader whose ``open`` waits for ``go`` once it has begun (``entered``)."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.entered = threading.Event()
        self.go = threading.Event()
        self.opened = []

    def __getattr__(self, name):  # the rest is the loader's
        return getattr(self.loader, name)

    def open(self, request):
        self.entered.set()
        assert self.go.wait(30)
        self.opened.append(self.loader.open(request))
        return self.opened[-1]


def test_a_close_during_an_open_in_another_thread_closes_what_it_opens(loader):
    """``close()`` while another thread's iteration is opening the job: the iteration ends
    with "closed" and the stream it opened is left, not kept open (where its take would wait
    for ever)."""
    slow = SlowOpen(loader)
    data = JobDataset("j", loader=slow)
    raised = []
    thread = threading.Thread(target=lambda: raised.extend(_raises(lambda: list(data))))
    thread.start()
    assert slow.entered.wait(30)
    data.close()
    slow.go.set()
    thread.join(30)
    assert not thread.is_alive()
    assert [str(e) for e in raised] == ["Job stream 'j' is closed; open the job again."]
    with pytest.raises(LoaderError, match="is closed"):
        slow.opened[0].take(None)
    slow.go.set()
    assert len(epoch_ids(data)) == len(loader.catalog.job("j").ids)  # iterating again reopens
    data.close()


def _raises(work) -> list[BaseException]:
    try:
        work()
    except LoaderError as exc:
        return [exc]
    return []


def test_worker_processes_are_refused(loader):
    data = JobDataset("j", loader=loader)
    batches = iter(DataLoader(data, batch_size=None, num_workers=1, multiprocessing_context="fork"))
    with pytest.raises(LoaderError, match="num_workers=0") as raised:
        next(batches)
    data.close()
    # Its worker stops now: left in the error's reference cycle to the collector, which closes
    # the worker's queue first, the iterator's shutdown would wait 5 s for a worker told nothing.
    traceback.clear_frames(raised.tb)
    del batches


def test_default_seed_is_the_jobs_option_else_its_own(loader):
    loader.catalog.sql("REGISTER JOB k SELECT image FROM imgs WITH (image_size = 16)")
    loader.catalog.sql("REGISTER JOB m SELECT image FROM imgs WITH (image_size = 16)")

    def first_draw(job: str) -> float:
        return torch.rand(1, generator=JobDataset(job, loader=loader).generator).item()

    assert first_draw("j") == torch.rand(1, generator=torch.Generator().manual_seed(3)).item()
    assert first_draw("k") == first_draw("k")  # deterministic per job
    assert first_draw("k") != first_draw("m")  # jobs without a seed never share draws


def test_a_catalog_path_open_in_this_process_must_be_shared(loader):
    from tabloader.catalog import CatalogLockedError

    root = loader.catalog.root
    with pytest.raises(CatalogLockedError, match="open already in this process.*catalog= to"):
        JobDataset("j", catalog=root)
    data = JobDataset("j", catalog=loader.catalog)  # the open Catalog object: shared
    assert len(epoch_ids(data)) == loader.catalog.job("j").num_rows
    data.close()
    data.loader.close()  # the default loader of that catalog: no threads left behind
    with pytest.raises(TypeError, match="catalog= takes a catalog directory or an open Catalog"):
        JobDataset("j", catalog=loader)


def test_a_job_process_imports_neither_duckdb_nor_the_engine():
    """Through the service a job process needs the client only: DuckDB, sqlglot, the engine
    and the cluster layer cost 0.3-0.4 s of every job process's start (four at once), and
    pyarrow (through the storage package) 0.1 s of its import."""
    from tests.support.imports import imported_after

    heavy = ("duckdb", "sqlglot", "pyarrow", "tabloader.catalog._catalog")
    heavy += ("tabloader.engine._loader", "tabloader.cluster")
    assert imported_after("import torch; from tabloader.torch import JobDataset", heavy) == []


def _use_in_child(data, out) -> None:
    try:
        next(iter(data))
        out.send(("no error", ""))
    except BaseException as exc:
        out.send((type(exc).__name__, str(exc)))


def test_a_forked_child_is_told_to_create_its_own_and_the_parent_goes_on(loader):
    data = JobDataset("j", loader=loader)
    batches = iter(data)
    ids = next(batches)["_id"].tolist()  # the parent's stream is open mid-epoch
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_use_in_child, args=(data, send))
    child.start()
    try:
        assert receive.poll(30), "the child did not answer"
        kind, message = receive.recv()
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join(30)
    assert kind == "LoaderError", message
    assert re.search(
        rf"JobDataset 'j' was created in process {os.getpid()} and is used in process \d+ "
        r"\(forked from it\); create the JobDataset in the child\.",
        message,
    )
    ids += [i for batch in batches for i in batch["_id"].tolist()]
    assert sorted(ids) == sorted(loader.catalog.job("j").ids)  # the parent's epoch, whole
    data.close()


def test_pickling_says_to_create_it_in_the_other_process(loader):
    data = JobDataset("j", loader=loader)
    with pytest.raises(TypeError, match=r"JobDataset \(job 'j'\) cannot be pickled: .* there"):
        pickle.dumps(data)
    data.close()


# -- importance = 'loss': reported losses ---------------------------------------------------
@pytest.fixture
def imp_loader(image_cat_dir):
    cat = catalog.open_catalog(image_cat_dir)
    cat.sql(
        "REGISTER JOB imp SELECT image, label FROM imgs WHERE label < 3 "
        "WITH (batch_size = 8, image_size = 16, seed = 3, importance = 'loss')"
    )
    cat.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (batch_size = 8, image_size = 16)")
    with Loader(cat, cache_bytes=8 << 20, workers=2) as engine:
        yield engine
    cat.close()


def saved_scores(data: JobDataset) -> ImportanceScores:
    return ImportanceScores.from_state(data.state_dict()["stream"]["importance"])


def shade_by_hand(reports: list[tuple[list[int], list[float]]]) -> dict[int, float]:
    """SHADE's score of each reported row, written out: log(#lower losses in its batch + 10);
    a later report replaces an earlier one; a row twice in one batch keeps its higher."""
    out: dict[int, float] = {}
    for ids, losses in reports:
        mine: dict[int, float] = {}
        for row, loss in zip(ids, losses, strict=True):
            score = math.log(sum(other < loss for other in losses) + 10)
            mine[row] = max(mine.get(row, 0.0), score)
        out.update(mine)
    return out


def test_two_ranks_report_into_one_set_of_scores(imp_loader):
    ranks = [JobDataset("imp", loader=imp_loader, rank=r, world_size=2) for r in (0, 1)]
    for data in ranks:
        assert data.epoch == 0  # opens both ranks before either waits for the other
    its = [iter(DataLoader(data, batch_size=None)) for data in ranks]
    reports = []
    for _ in range(2):
        for data, it in zip(ranks, its, strict=True):
            ids = next(it)["_id"]
            # a tensor with grad, on the device the model put it; bfloat16 as AMP gives
            losses = (ids.float() * 0.37 % 1.0).requires_grad_() * 2
            data.report(ids, losses if data.rank == 0 else losses.to(torch.bfloat16))
            sent = losses if data.rank == 0 else losses.to(torch.bfloat16).float()
            reports.append((ids.tolist(), sent.tolist()))
    want = shade_by_hand(reports)
    by_rank = [set(ids) for ids, _ in reports]
    assert by_rank[0] - by_rank[1]
    assert by_rank[1] - by_rank[0]
    for data in ranks:  # the job's one set, whichever rank saves
        scores = saved_scores(data)
        got = dict(zip(scores.ids.tolist(), scores.scores.tolist(), strict=True))
        assert {r: got[r] for r in want} == pytest.approx(want, rel=1e-12)
        assert all(got[r] == PRIOR for r in got if r not in want)
    for data in ranks:
        data.close()


def test_a_resume_restores_the_scores_exactly(imp_loader):
    data = JobDataset("imp", loader=imp_loader)
    it = iter(DataLoader(data, batch_size=None))
    for _ in range(3):
        batch = next(it)
        data.report(batch["_id"], (batch["_id"] * 7 % 5).double())
    before = saved_scores(data)
    assert (before.scores > PRIOR).sum() >= 8  # the reports changed them
    state = data.state_dict()
    data.close()
    again = JobDataset("imp", loader=imp_loader)
    again.load_state_dict(state)
    next(iter(DataLoader(again, batch_size=None)))  # the job reopens from the state
    after = saved_scores(again)
    np.testing.assert_array_equal(after.ranks, before.ranks)
    np.testing.assert_array_equal(after.probabilities(), before.probabilities())
    fresh = JobDataset("imp", loader=imp_loader)  # no state: a fresh start from the prior
    again.close()
    next(iter(DataLoader(fresh, batch_size=None)))
    assert (saved_scores(fresh).scores == PRIOR).all()
    fresh.close()


def test_report_errors_are_one_line_and_name_the_fix(imp_loader):
    plain = JobDataset("j", loader=imp_loader)
    with pytest.raises(LoaderError, match="report.* iterate it first"):
        plain.report(torch.tensor([1]), torch.tensor([0.5]))
    batch = next(iter(DataLoader(plain, batch_size=None)))
    with pytest.raises(LoaderError, match=r"WITH \(importance = 'loss'\)"):
        plain.report(batch["_id"], torch.zeros(len(batch["_id"])))
    plain.close()
    data = JobDataset("imp", loader=imp_loader)
    ids = next(iter(DataLoader(data, batch_size=None)))["_id"]
    n = len(ids)
    outside = max(imp_loader.catalog.job("j").ids)  # a row of label 3: not one of the job's
    bad = [
        (ids, torch.zeros(n, 2), "1-D arrays"),
        (ids, torch.zeros(n + 1), f"{n} ids and {n + 1} losses"),
        (ids, torch.full((n,), float("nan")), "non-finite losses"),
        (ids.float(), torch.zeros(n), "integer ids"),
        (np.zeros(65_537, np.int64), np.zeros(65_537), "more than 65536"),
        (torch.tensor([outside]), torch.tensor([1.0]), rf"rows \[{outside}\] .*not rows of"),
    ]
    before = saved_scores(data).ranks
    for ids_, losses, match in bad:
        with pytest.raises(LoaderError, match=match) as info:
            data.report(ids_, losses)
        assert "\n" not in str(info.value)
    np.testing.assert_array_equal(saved_scores(data).ranks, before)  # nothing scored
    data.close()
    stream = imp_loader.open("imp", epochs=1)
    ids = stream.next_batch()["_id"]
    stream.close()
    with pytest.raises(LoaderError, match="is closed; open the job again"):
        stream.report(ids, np.zeros(ids.size))
