from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import traceback

import pytest
import torch
from torch.utils.data import DataLoader

import catalog
from catalog import LoaderError, OptionError
from tabloader.engine import Loader
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
    from catalog import CatalogLockedError

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
    and the cluster layer cost 0.3-0.4 s of every job process's start (four at once)."""
    import subprocess
    import sys

    code = (
        "import sys, torch; from tabloader.torch import JobDataset; "
        "print(' '.join(m for m in ('duckdb', 'sqlglot', 'catalog.catalog', "
        "'tabloader.engine.loader', 'tabloader.cluster') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == []


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
