"""Data-parallel jobs: the ranks of one job join the loader as one job (threads as ranks)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pyroaring import BitMap

from tabloader.catalog import LoaderError
from tabloader.engine import Loader
from tabloader.engine._queue.ranks import VARIABLES, rank_share, resolve_rank
from tests.support.polling import wait_for
from tests.support.threads import JOIN_S, epochs_of, run_threads
from tests.support.wakeups import counting_waiter, held_for, next_batch_in_thread, waiting

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(loader, job: str, world_size: int, epochs: int, **options):
    """Every rank on its own thread for ``epochs`` epochs -> [rank][epoch] = batches' ids."""
    streams = [
        loader.open(job, rank=r, world_size=world_size, epochs=epochs, **options)
        for r in range(world_size)
    ]
    seen: list[list[list[list[int]]]] = [[] for _ in streams]
    run_threads(
        [
            lambda s=s, out=out: epochs_of(s, epochs, out)
            for s, out in zip(streams, seen, strict=True)
        ]
    )
    for s in streams:
        assert s.epoch == epochs
        s.close()
    return seen


def check_epoch(batches_per_rank, rows: set[int], batch_size: int) -> set[int]:
    """One epoch of every rank: disjoint equal shares of full batches; returns the dropped."""
    world_size = len(batches_per_rank)
    per_rank = len(rows) // (batch_size * world_size)
    union: set[int] = set()
    for batches in batches_per_rank:
        assert len(batches) == per_rank  # every rank gets the same number of batches
        assert all(len(b) == batch_size for b in batches)
        ids = {i for b in batches for i in b}
        assert len(ids) == per_rank * batch_size
        assert not ids & union  # disjoint
        union |= ids
    assert union <= rows
    dropped = rows - union
    assert len(dropped) == len(rows) % (batch_size * world_size) < batch_size * world_size
    return dropped


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "columns", ["image, label", "label"], ids=["decoded", "gathered"]
)  # the dependent and the independent sampler
def test_ranks_get_disjoint_equal_shares_and_a_random_remainder_is_dropped(
    images, world_size, columns
):
    images.sql(f"REGISTER JOB j SELECT {columns} FROM imgs WHERE label < 3 WITH (image_size = 8)")
    rows = set(images.job("j").ids)
    batch_size, epochs = 4, 5
    assert len(rows) % (batch_size * world_size)  # something to drop
    with Loader(images, cache_bytes=1 << 20, workers=2, seed=3) as loader:
        seen = run_ranks(loader, "j", world_size, epochs, batch_size=batch_size)
        group = loader.scheduler("imgs")
        assert "j" not in group.jobs  # it left with its last rank
        assert all(not counts.any() for counts in group.queues.future.uses.values())
        assert all(np.isinf(nxt).all() for nxt in group.queues.future.next_round.values())
    dropped = [
        check_epoch([seen[r][e] for r in range(world_size)], rows, batch_size)
        for e in range(epochs)
    ]
    assert len({frozenset(d) for d in dropped}) > 1  # not always the same rows: random


@pytest.mark.parametrize(
    ("rows", "batch_size", "world_size", "share"),
    [(10, 4, 1, 10), (10, 4, 2, 4), (16, 4, 2, 8), (17, 4, 2, 8), (7, 4, 2, 0), (60, 4, 3, 20)],
)
def test_each_rank_gets_full_batches_of_an_equal_share(rows, batch_size, world_size, share):
    assert rank_share(rows, batch_size, world_size) == share
    if world_size > 1:  # DistributedSampler(drop_last=True): full batches, < a round dropped
        assert share % batch_size == 0
        assert 0 <= rows - share * world_size < batch_size * world_size


def test_a_ddp_job_shares_decodes_with_another_job(images):
    """The ranks are one job of the dependent sampler: with a cache too small to keep rows
    long, the DDP job and a plain job decode each row about once (the independent sampler,
    the control, decodes more)."""
    images.sql("REGISTER JOB ddp SELECT image, label FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB plain SELECT image FROM imgs WITH (image_size = 16)")
    n = images.job("plain").num_rows
    one_row = 16 * 16 * 3
    decodes = {}
    for sampler in ("dependent", "independent"):
        # 20 rows: above the 16 pinned by the batches in flight, far below the 60 read
        with Loader(images, cache_bytes=20 * one_row, workers=2, sampler=sampler) as loader:
            opts = {"batch_size": 4, "prefetch": 1, "lookahead": 4, "epochs": 1}
            r0 = loader.open("ddp", rank=0, world_size=2, **opts)
            r1 = loader.open("ddp", rank=1, world_size=2, **opts)
            plain = loader.open("plain", batch_size=8, prefetch=1, lookahead=8, epochs=1)
            # one consumer taking a step of each (8 rows): the same pace, so the sampler's
            # effect is measured, not the consumer threads' scheduling by the OS
            got = {"r0": [], "r1": [], "plain": []}
            for b0, b1, bp in zip(r0, r1, plain, strict=False):
                got["r0"] += b0["_id"].tolist()
                got["r1"] += b1["_id"].tolist()
                got["plain"] += bp["_id"].tolist()
            got["plain"] += [i for b in plain for i in b["_id"].tolist()]
            assert list(r0) == list(r1) == []
            assert sorted(got["plain"]) == list(range(n))
            assert len(got["r0"]) == len(got["r1"]) == n // 8 * 4
            assert not set(got["r0"]) & set(got["r1"])
            decodes[sampler] = loader.stats()["decodes"]
    alone = n // 8 * 8 + n  # what each would decode on its own
    # (1.3 n failed 1 run in 8 on a loaded 2-core machine: the 20-row cache is tight)
    assert decodes["dependent"] <= 1.4 * n < 0.75 * alone
    assert decodes["independent"] >= 1.2 * n


def test_rank_and_world_size_from_the_environment(images, monkeypatch):
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20) as loader:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        one = loader.open("j", batch_size=5, epochs=1)
        assert (one.rank, one.world_size) == (1, 2)
        zero = loader.open("j", batch_size=5, epochs=1, rank=0, world_size=2)  # arguments win
        assert (zero.rank, zero.world_size) == (0, 2)
        seen: list[list[list[list[int]]]] = [[], []]
        run_threads([lambda: epochs_of(zero, 1, seen[0]), lambda: epochs_of(one, 1, seen[1])])
        assert check_epoch([seen[0][0], seen[1][0]], rows, 5) == set()
        zero.close()
        one.close()
        monkeypatch.delenv("RANK")
        monkeypatch.delenv("WORLD_SIZE")
        with loader.open("j", epochs=1) as plain:
            assert (plain.rank, plain.world_size) == (0, 1)


@pytest.fixture
def launcher(monkeypatch):
    """No launcher variable of this machine's environment leaks into a test: set ``env``."""
    for name in (*VARIABLES, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def setenv(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return setenv


TORCHRUN = {  # torchrun --nnodes 2 --nproc_per_node 2, node 1, its second process
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "ROLE_RANK": "3",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}
LIGHTNING_PARENT = {  # Trainer(devices=2, strategy="ddp"): the script's own process
    "LOCAL_RANK": "0",
    "NODE_RANK": "0",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "41234",
}
SRUN = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, (0, 1)),
        (TORCHRUN, (3, 4)),
        ({**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no"}, (3, 4)),  # accelerate launch
        ({**TORCHRUN, "NODE_RANK": "1"}, (3, 4)),  # Ray Train's TorchTrainer
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, (1, 2)),  # DeepSpeed
        (LIGHTNING_PARENT, (0, 2)),
        ({**LIGHTNING_PARENT, "LOCAL_RANK": "1"}, (1, 2)),  # the child it starts
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # no NODE_RANK: node 0
        ({"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, (3, 4)),
        (SRUN, (2, 4)),
        ({**SRUN, **TORCHRUN, "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (3, 4)),  # torchrun in
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (0, 1)),  # an sbatch script
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            (1, 2),
        ),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2)),  # a launcher of one machine
    ],
    ids=[
        "nothing",
        "master only",
        "torchrun",
        "accelerate launch",
        "ray train",
        "deepspeed",
        "lightning parent",
        "lightning child",
        "lightning no node rank",
        "lightning node 1",
        "srun",
        "torchrun inside srun",
        "sbatch",
        "one machine inside sbatch",
        "one machine",
    ],
)
def test_rank_from_each_launcher(launcher, env, expected):
    launcher(env)
    assert resolve_rank(None, None) == expected


def test_rank_from_a_launcher_at_open(images, launcher, monkeypatch):
    """Through ``Loader.open``: Lightning's child process, then srun's task."""
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        launcher({**LIGHTNING_PARENT, "LOCAL_RANK": "1"})
        with loader.open("j", batch_size=5, epochs=1) as stream:
            assert (stream.rank, stream.world_size) == (1, 2)
        for name in LIGHTNING_PARENT:
            monkeypatch.delenv(name)
        launcher(SRUN)
        with loader.open("j", batch_size=5, epochs=1) as stream:
            assert (stream.rank, stream.world_size) == (2, 4)


@pytest.mark.parametrize(
    "env",
    [
        TORCHRUN,
        {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "3"},  # contradicts itself
        {"RANK": "one", "WORLD_SIZE": "2"},
        {"LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4"},
    ],
)
def test_explicit_rank_wins_over_the_launcher(launcher, env):
    launcher(env)
    assert resolve_rank(1, 2) == (1, 2)
    assert resolve_rank(np.int64(0), 1) == (0, 1)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (
            {"RANK": "2", "WORLD_SIZE": "2"},
            r"rank=2, world_size=2 \(from RANK and WORLD_SIZE \(torchrun.*0 <= rank < world_size",
        ),
        ({"RANK": "one", "WORLD_SIZE": "2"}, r"rank='one', world_size=2 .*must be integers"),
        ({"WORLD_SIZE": "2"}, r"RANK=None and WORLD_SIZE='2': set both"),
        ({"LOCAL_RANK": "0"}, r"LOCAL_RANK='0' and LOCAL_WORLD_SIZE=None: set both"),
        (
            {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            r"rank=2, world_size=2 \(from LOCAL_RANK and LOCAL_WORLD_SIZE",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            r"rank 0 of 2 from RANK and WORLD_SIZE .*, beside LOCAL_RANK=1 .*cannot be above",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
            r"rank 1 of 2 from RANK .*LOCAL_WORLD_SIZE=4: .*nor the ranks on a machine more",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "x"},
            r"rank='x', world_size=2 \(from LOCAL_RANK and LOCAL_WORLD_SIZE.*must be integers",
        ),
        (  # Lightning's launcher on a second machine: its rank is unknown
            {"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"},
            r"NODE_RANK=1 without LOCAL_WORLD_SIZE: .*until the Trainer initialises "
            r"torch\.distributed",
        ),
        (
            {"LOCAL_RANK": "2", "NODE_RANK": "0", "WORLD_SIZE": "2"},
            r"rank=2, world_size=2 \(from LOCAL_RANK, NODE_RANK and WORLD_SIZE \(Lightning",
        ),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "two"}, r"WORLD_SIZE='two' is not an integer"),
        (
            {"SLURM_PROCID": "4", "SLURM_NTASKS": "4"},
            r"rank=4, world_size=4 \(from SLURM_PROCID and SLURM_NTASKS \(srun\)",
        ),
        ({"SLURM_NTASKS": "2"}, r"SLURM_PROCID=None and SLURM_NTASKS='2': set both"),
        (  # a launcher of one machine in each of two tasks: the rank in the job is unknown
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            r"rank 0 of 2 from SLURM_PROCID and SLURM_NTASKS \(srun\), beside LOCAL_RANK=1",
        ),
    ],
)
def test_bad_launcher_environment(images, launcher, env, match):
    """Each error names the problem, every launcher variable seen and the fix; at open, it
    leaves nothing behind."""
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    launcher({**env, "MASTER_ADDR": "127.0.0.1"})  # not a launcher variable: not listed
    with Loader(images, cache_bytes=1 << 20) as loader:
        with pytest.raises(LoaderError, match=match) as caught:
            loader.open("j")
        assert loader.stats()["jobs"] == {}
    message = str(caught.value)
    seen = "; ".join(f"{k}={env[k]}" for k in VARIABLES if k in env)  # in that order
    assert f"Seen: {seen}. " in message
    assert "MASTER_ADDR" not in message
    assert "JobDataset(rank=..., world_size=...) (or Loader.open" in message


@pytest.fixture
def process_group(tmp_path):
    """A real, initialised gloo process group of one process (rank 0 of 1)."""
    dist = pytest.importorskip("torch.distributed")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=(tmp_path / "group").as_uri(), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},  # agree
        {"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "1"},  # Lightning's, agreeing
        {"LOCAL_RANK": "0", "NODE_RANK": "0"},  # Lightning's after fit (WORLD_SIZE deleted)
        {"WORLD_SIZE": "3"},  # half a pair beside a group: stale, not read
        SRUN,  # the group is the truth: srun's tasks are not held against it
    ],
)
def test_rank_from_an_initialised_process_group(launcher, process_group, env):
    launcher(env)
    assert resolve_rank(None, None) == (0, 1)
    assert resolve_rank(1, 2) == (1, 2)  # explicit arguments win


def test_without_the_group_the_same_environment_says_otherwise(launcher):
    """The control of the test above: its last environments without a group."""
    launcher(SRUN)
    assert resolve_rank(None, None) == (2, 4)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        (
            {"RANK": "1", "WORLD_SIZE": "2"},
            r"rank 0 of 1 from torch\.distributed's process group, but rank 1 of 2 from RANK "
            r"and WORLD_SIZE \(torchrun",
        ),
        ({"RANK": "0", "WORLD_SIZE": "4"}, r"rank 0 of 1 from .*, but rank 0 of 4 from RANK"),
        (
            LIGHTNING_PARENT,
            r"rank 0 of 1 from torch\.distributed's process group, but rank 0 of 2 from "
            r"LOCAL_RANK, NODE_RANK and WORLD_SIZE \(Lightning's launcher\)",
        ),
        (
            {"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "4"},
            r"but an unknown rank of 4 from LOCAL_RANK, NODE_RANK and WORLD_SIZE",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1"},
            r"rank 0 of 1 from torch\.distributed's process group, beside LOCAL_RANK=1",
        ),
    ],
)
def test_a_process_group_that_disagrees_with_the_environment(launcher, process_group, env, match):
    launcher(env)
    with pytest.raises(LoaderError, match=match) as caught:
        resolve_rank(None, None)
    message = str(caught.value)
    assert "Seen: torch.distributed's process group: rank 0 of 1; " in message
    assert all(f"{k}={v}" in message for k, v in env.items() if k in VARIABLES)
    assert "JobDataset(rank=..., world_size=...)" in message


def fake_group(monkeypatch, rank: int, world_size: int) -> None:
    """An initialised process group of ``world_size`` processes seen from ``rank`` (a real
    one needs them all)."""
    group = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        get_rank=lambda: rank,
        get_world_size=lambda: world_size,
    )
    monkeypatch.setitem(sys.modules, "torch.distributed", group)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        {**LIGHTNING_PARENT, "LOCAL_RANK": "1"},
        {"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "2"},  # rank unknown, size agrees
    ],
)
def test_rank_one_of_a_process_group(launcher, monkeypatch, env):
    launcher(env)
    fake_group(monkeypatch, 1, 2)
    assert resolve_rank(None, None) == (1, 2)


def test_a_process_group_of_another_rank_than_the_environment(launcher, monkeypatch):
    launcher({**LIGHTNING_PARENT, "LOCAL_RANK": "0"})
    fake_group(monkeypatch, 1, 2)
    with pytest.raises(
        LoaderError, match=r"rank 1 of 2 from .*process group, but rank 0 of 2 from LOCAL_RANK"
    ):
        resolve_rank(None, None)


def test_rank_from_accelerate_state_of_several_processes(launcher, monkeypatch):
    """accelerate's state where no process group is initialised (TPUs): read when it holds
    more than one process; one process is what no launcher says anyway."""
    state = pytest.importorskip("accelerate.state")
    shared = state.PartialState._shared_state
    for key, value in {"process_index": 1, "num_processes": 3}.items():
        monkeypatch.setitem(shared, key, value)
    assert resolve_rank(None, None) == (1, 3)
    launcher({"RANK": "1", "WORLD_SIZE": "3"})
    assert resolve_rank(None, None) == (1, 3)
    launcher({"RANK": "2", "WORLD_SIZE": "3"})
    with pytest.raises(
        LoaderError,
        match=r"rank 1 of 3 from accelerate's process state, but rank 2 of 3 from RANK",
    ):
        resolve_rank(None, None)
    monkeypatch.setitem(shared, "num_processes", 1)  # one process: lingers, not read
    monkeypatch.setitem(shared, "process_index", 0)
    assert resolve_rank(None, None) == (2, 3)


def test_finding_the_rank_imports_no_torch():
    """The engine and service never import torch: with torch not imported, the rank comes
    from the environment alone."""
    code = (
        "import sys\n"
        "from tabloader.engine._queue.ranks import resolve_rank\n"
        "assert resolve_rank(None, None) == (1, 2), resolve_rank(None, None)\n"
        "assert 'torch' not in sys.modules and 'accelerate' not in sys.modules\n"
    )
    env = {**os.environ, "LOCAL_RANK": "1", "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_open_errors_of_ranks(images):
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    images.sql("REGISTER JOB k SELECT label FROM imgs")
    with Loader(images, cache_bytes=1 << 20) as loader:
        r0 = loader.open("j", batch_size=4, rank=0, world_size=2)
        with pytest.raises(LoaderError, match="Rank 0 of job 'j' is open already"):
            loader.open("j", batch_size=4, rank=0, world_size=2)
        with pytest.raises(
            LoaderError,
            match=r"Job 'j' is open already in this loader with world_size=2, and this open "
            r"asks for world_size=3",
        ):
            loader.open("j", batch_size=4, rank=1, world_size=3)
        with pytest.raises(  # a plain open is world_size 1
            LoaderError, match=r"Job 'j' is open already in this loader with world_size=2.*=1"
        ):
            loader.open("j", batch_size=4)
        with pytest.raises(LoaderError, match=r"other options.*batch_size=5 \(rank 0's: 4\)"):
            loader.open("j", batch_size=5, rank=1, world_size=2)
        with pytest.raises(LoaderError, match=r"other options.*on_error='skip' \(rank 0's: 'r"):
            loader.open("j", batch_size=4, on_error="skip", rank=1, world_size=2)
        state = {"job": "j", "epoch": 0, "remaining": images.job("j").ids.serialize()}
        with pytest.raises(LoaderError, match="Rank 1 of job 'j' was opened with another state"):
            loader.open("j", batch_size=4, rank=1, world_size=2, state=state)
        r1 = loader.open("j", batch_size=4, rank=1, world_size=2)
        r1.close()  # r0 goes on alone
        with pytest.raises(LoaderError, match="Rank 1 of job 'j' left.*cannot rejoin"):
            loader.open("j", batch_size=4, rank=1, world_size=2)
        r0.close()
        again = loader.open("j", batch_size=4, rank=1, world_size=2)  # a new run of the job
        again.close()
        with pytest.raises(LoaderError, match=r"has 60 rows, fewer than batch_size \(16\) x"):
            loader.open("k", batch_size=16, rank=0, world_size=4)
        plain = loader.open("k")
        with pytest.raises(LoaderError, match="Job 'k' is open already in this loader; close"):
            loader.open("k")  # unchanged for plain jobs
        plain.close()


def test_resume_all_ranks_from_a_state_saved_at_the_same_step(images):
    images.sql("REGISTER JOB j SELECT image, label FROM imgs WHERE label > 0 WITH (image_size = 8)")
    rows = set(images.job("j").ids)
    batch_size, world_size = 4, 2
    assert len(rows) % (batch_size * world_size)  # something to drop
    assert len(rows) > 3 * batch_size * world_size  # something left after 2 steps
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        opts = {"batch_size": batch_size, "world_size": world_size, "prefetch": 2}
        streams = [loader.open("j", rank=r, **opts) for r in range(world_size)]
        r0, r1 = streams
        # the state is the job's at the saving rank's step, wherever the others are: rank 0
        # saves at step 2 before rank 1 has taken a batch, and again once rank 1 is ahead
        before = [[r0.next_batch()["_id"].tolist() for _ in range(2)], []]
        saved = r0.state_dict()
        before[1] = [r1.next_batch()["_id"].tolist() for _ in range(2)]
        assert r1.state_dict() == saved  # the same step, the same state
        ahead = r1.next_batch()["_id"].tolist()  # rank 1's step 3: not in the checkpoint
        assert r0.state_dict() == saved
        assert r1.state_dict() != saved
        assert saved["epoch"] == 0
        for s in streams:
            s.close()
        resumed = [loader.open("j", rank=r, state=saved, epochs=2, **opts) for r in range(2)]
        after: list[list[list[list[int]]]] = [[], []]
        run_threads(
            [
                lambda s=s, out=out: epochs_of(s, 2, out)
                for s, out in zip(resumed, after, strict=True)
            ]
        )
        for s in resumed:
            s.close()
    epoch0 = [before[r] + after[r][0] for r in range(world_size)]
    dropped = check_epoch(epoch0, rows, batch_size)  # each row once, before or after
    assert set(ahead) <= {i for b in after[0][0] + after[1][0] for i in b} | dropped
    assert len(dropped) == len(rows) % (batch_size * world_size)
    check_epoch([after[r][1] for r in range(world_size)], rows, batch_size)


def test_a_rank_that_closes_does_not_hold_up_the_others(images):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 8)")
    images.sql("REGISTER JOB other SELECT image FROM imgs WITH (image_size = 8)")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        opts = {"batch_size": 5, "world_size": 2, "prefetch": 2, "epochs": 2}
        r0 = loader.open("j", rank=0, **opts)
        r1 = loader.open("j", rank=1, **opts)
        other = loader.open("other", batch_size=5, epochs=1)
        first = r1.next_batch()["_id"].tolist()  # then rank 1 stops consuming
        seen: list[list[list[int]]] = []
        consumer = threading.Thread(target=epochs_of, args=(r0, 2, seen), daemon=True)
        consumer.start()
        wait_for(lambda: r0.stats()["batches"] >= 2, "rank 0 consumed")
        time.sleep(0.2)  # rank 0 reaches the batches dealt to rank 1: it waits (lockstep)
        assert consumer.is_alive()
        assert r0.stats()["batches"] < len(rows) // 10  # held up mid-epoch by rank 1
        r1.close()  # the rest of its share is dropped
        consumer.join(JOIN_S)
        assert not consumer.is_alive(), "rank 0 still waits for the rank that left"
        assert [len(e) for e in seen] == [len(rows) // 10] * 2  # its whole share
        for epoch in seen:
            ids = [i for b in epoch for i in b]
            assert len(ids) == len(set(ids)) == len(rows) // 10 * 5
        assert not set(first) & {i for b in seen[0] for i in b}
        assert "j" in loader.stats()["jobs"]
        r0.close()
        assert "j" not in loader.stats()["jobs"]
        assert sorted(i for b in other for i in b["_id"].tolist()) == sorted(rows)


def test_a_dropped_rank_is_closed_and_the_others_go_on(images):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 8)")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        opts = {"batch_size": 5, "world_size": 2, "prefetch": 1, "epochs": 1}
        r0 = loader.open("j", rank=0, **opts)
        r1 = loader.open("j", rank=1, **opts)
        r1.next_batch()
        del r1  # a training thread that died without close()
        gc.collect()
        seen: list[list[list[int]]] = []
        run_threads([lambda s=r0: epochs_of(s, 1, seen)])
        assert len(seen[0]) == len(rows) // 10
        assert "j" in loader.stats()["jobs"]
        del r0
        gc.collect()
        wait_for(lambda: "j" not in loader.stats()["jobs"], "the scheduler closed job j")
        wait_for(lambda: loader.stats()["cache"].pinned == 0, "every pin released")


def test_a_rank_waiting_for_its_batch_sleeps_while_the_others_land_and_wakes_on_close(
    images, monkeypatch
):
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    images.sql("REGISTER JOB other SELECT label FROM imgs")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20) as loader:
        other = loader.open("other", batch_size=5)
        group = loader.scheduler("imgs")
        held = held_for(group, monkeypatch, "j")  # j's batches land when the test says
        opts = {"batch_size": 5, "world_size": 2, "prefetch": 2, "epochs": 1}
        r0 = loader.open("j", rank=0, **opts)
        r1 = loader.open("j", rank=1, **opts)
        cond = counting_waiter(group, r0)
        outcome: list[BaseException] = []
        consumer = next_batch_in_thread(r0, outcome)
        wait_for(lambda: waiting(cond), "rank 0 waits for its batch")
        # the rank may wait before the scheduler dealt (one CI run): dealt to both, none landed
        wait_for(lambda: {w.job.rank for w in held} == {0, 1}, "work dealt to both ranks")
        for work in [w for w in held if w.job.rank == 1]:  # rank 1's land now
            held.remove(work)
            held.land(work)
        first = [r1.next_batch()["_id"].tolist() for _ in range(2)]
        other.next_batch()
        assert consumer.is_alive()
        assert cond.notified == 0  # none of those was rank 0's: nobody woke it

        closer = threading.Thread(target=r0.close, daemon=True)  # from a third thread
        closer.start()
        closer.join(JOIN_S)
        consumer.join(JOIN_S)
        assert not closer.is_alive()
        assert not consumer.is_alive(), "rank 0 still waits after its stream closed"
        assert len(outcome) == 1
        assert isinstance(outcome[0], LoaderError)
        assert "Job stream 'j' (rank 0 of 2) is closed" in str(outcome[0])
        monkeypatch.undo()  # the batches dealt from now on land as usual
        for work in held:  # rank 0's land late, closed: nothing waits for them
            held.land(work)
        rest: list[list[list[int]]] = []
        run_threads([lambda: rest.append([b["_id"].tolist() for b in r1])])  # rank 1 goes on
        assert len(first) + len(rest[0]) == len(rows) // 10  # its whole share of the epoch
        r1.close()
        other.close()


def test_a_rank_waiting_for_a_dropped_rank_wakes_the_scheduler(images, monkeypatch):
    """The scheduler closes dropped streams when it polls, and at once when a rank waits for
    one: with a poll too long to wait for, rank 0 still reads its epoch."""
    import tabloader.engine._queue.scheduler

    monkeypatch.setattr(tabloader.engine._queue.scheduler, "ABANDONED_CHECK_S", 3600.0)
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20) as loader:
        opts = {"batch_size": 5, "world_size": 2, "prefetch": 1, "epochs": 1}
        r0 = loader.open("j", rank=0, **opts)
        r1 = loader.open("j", rank=1, **opts)
        r1.next_batch()
        del r1  # a training thread that died without close(); rank 0 soon waits for it
        gc.collect()
        seen: list[list[list[int]]] = []
        run_threads([lambda: epochs_of(r0, 1, seen)])
        assert len(seen[0]) == len(rows) // 10
        r0.close()


def test_ranks_wait_for_a_rank_that_has_not_opened_yet(images):
    images.sql("REGISTER JOB j SELECT label FROM imgs")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20) as loader:
        opts = {"batch_size": 5, "world_size": 2, "prefetch": 2, "epochs": 1}
        r0 = loader.open("j", rank=0, **opts)
        cond = counting_waiter(loader.scheduler("imgs"), r0)
        seen: list[list[list[list[int]]]] = [[], []]
        consumer = threading.Thread(target=epochs_of, args=(r0, 1, seen[0]), daemon=True)
        consumer.start()
        wait_for(lambda: waiting(cond), "rank 0 waits for rank 1")
        assert consumer.is_alive()  # batches are dealt to rank 1 already: rank 0 waits
        r1 = loader.open("j", rank=1, **opts)
        run_threads([lambda: epochs_of(r1, 1, seen[1])])
        consumer.join(JOIN_S)
        assert not consumer.is_alive()
        check_epoch([seen[0][0], seen[1][0]], rows, 5)
        stats = loader.stats()["jobs"]["j"]
        assert stats["world_size"] == 2
        assert [s["rank"] for s in stats["ranks"]] == [0, 1]
        assert stats["batches"] == sum(s["batches"] for s in stats["ranks"]) == len(rows) // 5
        assert r0.stats()["rows"] == r1.stats()["rows"] == len(rows) // 2
        r0.close()
        r1.close()


def test_job_dataset_ranks(images):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from tabloader.torch import JobDataset

    images.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (image_size = 8, batch_size = 4)")
    rows = set(images.job("j").ids)
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        data = [JobDataset("j", loader=loader, rank=r, world_size=3) for r in range(3)]
        seen: list[list[list[int]]] = [[] for _ in data]

        def epoch(r: int) -> None:
            for batch in DataLoader(data[r], batch_size=None):
                assert isinstance(batch["image"], torch.Tensor)
                seen[r].append(batch["_id"].tolist())

        run_threads([lambda r=r: epoch(r) for r in range(3)])
        check_epoch(seen, rows, 4)
        assert data[2].stats()["rank"] == 2
        for d in data:
            d.close()


def test_future_uses_match_the_queues_with_ranks(images):
    """The arena's eviction inputs stay exact with ranks: dealt, dropped and left rows."""
    images.sql("REGISTER JOB d SELECT image FROM imgs WHERE label < 3 WITH (image_size = 8)")
    images.sql("REGISTER JOB p SELECT image FROM imgs WHERE label > 0 WITH (image_size = 8)")
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        ranks = [loader.open("d", batch_size=4, rank=r, world_size=3) for r in range(3)]
        plain = loader.open("p", batch_size=5)
        group = loader.scheduler("imgs")
        for step in range(45):
            if step == 30:
                ranks.pop().close()  # the others go on without rank 2
            for stream in (*ranks, plain):
                stream.next_batch()
            with group.cond:
                for space, counts in group.queues.future.uses.items():
                    want = np.zeros_like(counts)
                    nxt = np.full(counts.size, np.inf)
                    for job in group.jobs.values():
                        queued = job.queue.q_rows.tolist()
                        if job.queue.left:
                            queued += list(job.source.sampler.remaining(job.name))
                        np.add.at(want, np.array(queued, dtype=np.intp), 1)
                        np.minimum.at(nxt, job.queue.q_rows, job.queue.q_rounds)
                    assert counts.tolist() == want.tolist(), step
                    assert group.queues.future.next_round[space].tolist() == nxt.tolist(), step
        for stream in (*ranks, plain):
            stream.close()
        assert all(not counts.any() for counts in group.queues.future.uses.values())


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_state_one_undelivered_batch_back_is_the_state_before_it(images, world_size):
    """What a service's client saves while it holds a batch it read ahead: the state of the
    step before, across an epoch's end (and its dropped rows) too."""
    images.sql("REGISTER JOB j SELECT image FROM imgs WHERE label > 0 WITH (image_size = 8)")
    n = len(images.job("j").ids)
    steps = 2 * (n // (4 * world_size)) + 2  # into the third epoch
    epochs = set()
    with Loader(images, cache_bytes=1 << 20, workers=2) as loader:
        ranks = [
            loader.open("j", batch_size=4, rank=r, world_size=world_size, prefetch=2)
            for r in range(world_size)
        ]

        def state(**back: int) -> tuple[int, set[int]]:
            saved = ranks[0].state_dict(**back)
            return saved["epoch"], set(BitMap.deserialize(saved["remaining"]))

        before = state()
        for _ in range(steps):
            for r in ranks:
                r.next_batch()
            assert state(undelivered=1) == before
            before = state()
            epochs.add(before[0])
        for r in ranks:
            r.close()
    assert epochs == {0, 1, 2}
