"""Real training frameworks over one job: Lightning, the Hugging Face Trainer, accelerate.

Each case launches the framework as users do (a script; torchrun for 2 processes; Lightning's
own launcher for its DDP) from ``tests/integrations/``. The scripts record the
``_id`` values of every batch they train, per rank; the checks here are per epoch: the union
over ranks is the job's rows less the documented drop (the last ``n % (batch_size *
world_size)`` rows of the epoch's order), each row once. A first run saves a checkpoint part
of the way into epoch 1 and exits at once (a crash); a fresh process resumes from the
checkpoint, and epoch 1 over both runs must still hold each row once.

The recipes of docs/frameworks.md and the test that runs each:

* plain PyTorch and torchrun: ``tests/service/test_service.py``
  (``test_two_training_scripts_share_one_service_exactly_once_each``,
  ``test_torchrun_trains_two_cpu_ranks_over_gloo_on_one_job``), the checkpoint's
  ``torch.save``/``torch.load`` round trip here
  (``test_a_state_saved_with_torch_save_resumes_the_epoch``);
* Lightning: ``test_lightning_one_process_*``, ``test_lightning_ddp_*`` (``lightning_run.py``);
* Hugging Face Trainer: ``test_hf_trainer_*`` (``hf_run.py``);
* accelerate: ``test_accelerate_*`` (``accelerate_run.py``);
* Ray Train: ``tests/cluster/test_cluster_ray.py``
  (``test_ray_train_ranks_split_each_epoch``: ``JobDataset`` in a ``TorchTrainer``'s train
  function, 2 workers, each its share of the epoch from the ranks Ray Train sets).

The launched ones run one after another in one xdist worker (group ``frameworks``) and are
marked slow: each launch imports torch and the framework (a few seconds each on 2 cores).
The last tests run in this process: the integrations' bookkeeping and errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from tabloader import catalog
from tabloader.catalog._errors import ServiceError
from tabloader.engine._arena.shm import shm_available

# one group per test, not per module: xdist joins a test's groups into one name
frameworks = pytest.mark.xdist_group("frameworks")


@pytest.mark.parametrize("framework", ["lightning", "transformers", "accelerate"])
def test_the_frameworks_are_installed(framework):
    """The test extra installs them: a run without one fails here (and in its tests) instead
    of skipping what it cannot check."""
    import importlib.util

    assert importlib.util.find_spec(framework) is not None, (
        f"{framework} is not installed: pip install -e '.[test]' (torch pinned first)"
    )


pytestmark = [
    pytest.mark.skipif(not shm_available(), reason="no /dev/shm (O_TMPFILE) on this system"),
    pytest.mark.timeout(600),
]

SCRIPTS = Path(__file__).parent  # the scripts each framework launches, beside this file
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # one launch: imports, the service's start, two epochs of 100 tiny images
ROWS = 100  # the job's rows: all images
VAL_ROWS = 25  # label 0
BATCH = 8


@pytest.fixture(scope="module")
def cat_dir():
    """A catalog of 100 small JPEGs (4 classes) and a job per case, all ``batch_size = 8``
    at 8x8; its loader service is started by the first script and stopped here."""
    from tabloader.datagen import make_imagefolder

    base = Path(tempfile.mkdtemp(prefix="tl-fw-", dir="/tmp"))  # short: socket paths
    folder = make_imagefolder(base / "images", num_images=ROWS, num_classes=4, size=(24, 16))
    root = base / "cat"
    with catalog.open_catalog(root, create=True) as cat:
        cat.import_imagefolder("imgs", folder)
        options = f"WITH (batch_size = {BATCH}, image_size = 8)"
        for job in ("l1", "l1_limit", "l1_plain", "ddp", "hf", "acc"):
            cat.sql(f"REGISTER JOB {job} SELECT image, label FROM imgs {options}")
        quick = f"WITH (batch_size = {BATCH}, image_size = 8, rank_timeout = 2)"
        cat.sql(f"REGISTER JOB acc_plain SELECT image, label FROM imgs {quick}")
        cat.sql(f"REGISTER JOB val SELECT image, label FROM imgs WHERE label = 0 {options}")
        rows = {job: set(cat.job(job).ids) for job in ("l1", "val")}
    assert (len(rows["l1"]), len(rows["val"])) == (ROWS, VAL_ROWS)
    yield root
    stop_service(root)
    shutil.rmtree(base, ignore_errors=True)


def stop_service(root: Path) -> None:
    """The service the scripts started: stopped now rather than when idle."""
    from tabloader.service._client import RemoteLoader

    try:
        with RemoteLoader(root, start=False) as remote:
            pid = remote.service_pid
    except ServiceError:
        return  # none runs
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


def launch(*command: str | Path, torchrun: int = 0) -> subprocess.CompletedProcess[str]:
    """Run a script of ``integrations/`` (under ``torchrun --nproc_per_node N`` with
    ``torchrun=N``) to its end, bounded; on a hang its whole process tree is killed."""
    prefix = [sys.executable]
    if torchrun:
        prefix += ["-m", "torch.distributed.run", "--nproc_per_node", str(torchrun)]
        prefix += ["--master_port", str(free_port())]
    env = {
        **os.environ,
        # the scripts' _common.py, also for Ray's workers (they inherit this environment)
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TABLOADER_IDLE_EXIT": "20",  # the service outlives a test's runs, not the module
        "TOKENIZERS_PARALLELISM": "false",
    }
    proc = subprocess.Popen(
        [*prefix, *map(str, command)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=SCRIPTS,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{command} hung; its stderr:\n{stderr[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


UNSAVED = "position of job"  # tabloader's warning of a checkpoint without the job's position


def succeeds(*command: str | Path, torchrun: int = 0) -> str:
    """Run a script (``launch``) that must succeed, and whose checkpoints carry the job's
    position (no warning of tabloader says otherwise); its stdout."""
    result = launch(*command, torchrun=torchrun)
    assert result.returncode == 0, result.stderr[-6000:]
    assert UNSAVED not in result.stderr, result.stderr[-6000:]
    return result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True, check=True)
    children: dict[int, list[int]] = defaultdict(list)
    for line in out.stdout.splitlines()[1:]:
        child, parent = map(int, line.split())
        children[parent].append(child)
    found, todo = set(), [pid]
    while todo:
        for c in children[todo.pop()]:
            found.add(c)
            todo.append(c)
    return found


def recorded(out: Path, kind: str = "train") -> dict[int, list[int]]:
    """The ``_id`` values of every batch recorded, by epoch, over all ranks and runs."""
    epochs: dict[int, list[int]] = defaultdict(list)
    for path in sorted(out.glob(f"{kind}-rank*.jsonl")):
        for line in path.read_text().splitlines():
            batch = json.loads(line)
            epochs[batch["epoch"]] += batch["ids"]
    return dict(epochs)


def batches(out: Path, kind: str = "train") -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(out.glob(f"{kind}-rank*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def job_rows(root: Path, job: str) -> set[int]:
    import tabloader

    with tabloader.connect(root) as cat:  # through the service if one runs
        return set(cat.job(job).ids)


def trained(rows: int, world_size: int) -> int:
    """Rows of an epoch trained over ``world_size`` ranks: all with one (its last batch
    short), else all but the last ``rows % (batch_size * world_size)`` of the epoch's order."""
    return rows if world_size == 1 else rows - rows % (BATCH * world_size)


def assert_epoch(ids: list[int], rows: set[int], world_size: int) -> None:
    """One epoch of a training job: each row at most once, all but the documented drop."""
    duplicates = [i for i, n in Counter(ids).items() if n > 1]
    assert not duplicates, f"rows trained twice in one epoch: {sorted(duplicates)}"
    assert set(ids) <= rows
    assert len(ids) == trained(len(rows), world_size)


def assert_evaluation(ids: list[int], rows: set[int], world_size: int) -> None:
    """One evaluation epoch (``drop_last = false``): every row; under DDP the last batches
    padded with rows of the epoch, as ``DistributedSampler`` pads (to a multiple of the
    world size)."""
    assert set(ids) == rows
    padded = -len(rows) % world_size
    assert len(ids) == len(rows) + padded


def assert_two_epochs(out: Path, rows: set[int], world_size: int, kind: str = "train") -> None:
    """Epochs 0 and 1 of ``kind`` were recorded, each whole: a training epoch as
    ``assert_epoch`` checks it, an evaluation (``kind="val"``) as ``assert_evaluation``."""
    check = assert_evaluation if kind == "val" else assert_epoch
    epochs = recorded(out, kind)
    assert sorted(epochs) == [0, 1]
    for ids in epochs.values():
        check(ids, rows, world_size)


@pytest.mark.slow
@frameworks
def test_lightning_one_process_resumes_mid_epoch_and_at_an_epochs_end(cat_dir, tmp_path):
    """``return JobLoader(ds)`` in a 1-process Lightning Trainer: its checkpoints carry the
    job's position (Lightning saves ``state_dict()`` of a train loader that has one), a
    resume from step 13 + 5 (epoch 1, batch 5) in a fresh process trains the rest of epoch 1
    exactly; one from the end of epoch 0 trains epoch 1 whole. The validation job: the
    sanity check's 2 batches, then every validation a whole epoch of the job."""
    rows, val_rows = job_rows(cat_dir, "l1"), job_rows(cat_dir, "val")
    per_epoch = -(-ROWS // BATCH)  # 13 batches, the last of 4 rows
    mid, end = tmp_path / "mid.ckpt", tmp_path / "end.ckpt"
    common = ["--catalog", cat_dir, "--job", "l1", "--val-job", "val", "--out", tmp_path]
    succeeds(
        "lightning_run.py",
        *common,
        *("--stop-after", per_epoch + 5, "--ckpt", mid, "--epoch-end-ckpt", end),
    )
    first = recorded(tmp_path)
    assert len(first[1]) == 5 * BATCH  # the crash after step 18
    succeeds("lightning_run.py", *common, "--resume", mid, "--tag", "resumed")
    assert_two_epochs(tmp_path, rows, 1)
    sanity = batches(tmp_path, "sanity")
    assert len(sanity) == 2  # the first run's; the resumed run has none (it restarts)
    # evaluations whole, though the sanity check read part of one
    assert_two_epochs(tmp_path, val_rows, 1, "val")

    out = tmp_path / "from-end"
    out.mkdir()
    succeeds(
        "lightning_run.py",
        *("--catalog", cat_dir, "--job", "l1", "--out", out, "--resume", end),
    )
    epochs = recorded(out)
    assert sorted(epochs) == [1]  # epoch 0 was done
    assert_epoch(epochs[1], rows, 1)


@pytest.mark.slow
@frameworks
def test_lightning_limit_train_batches_gives_short_whole_epochs(cat_dir, tmp_path):
    """``limit_train_batches=3``: each epoch is 3 batches of a new epoch of the job (the rest
    of the job's epoch is abandoned and counted), not the next 3 batches of one epoch."""
    rows = job_rows(cat_dir, "l1_limit")
    common = ["--catalog", cat_dir, "--job", "l1_limit", "--out", tmp_path]
    stdout = succeeds("lightning_run.py", *common, "--limit-train-batches", 3, "--epochs", 3)
    trained = batches(tmp_path)
    assert [b["epoch"] for b in trained] == [0] * 3 + [1] * 3 + [2] * 3
    for epoch in range(3):
        ids = [i for b in trained if b["epoch"] == epoch for i in b["ids"]]
        assert len(set(ids)) == 3 * BATCH
        assert set(ids) <= rows
    abandoned = ROWS - 3 * BATCH
    assert f"abandoned_rows={2 * abandoned}" in stdout  # epochs 0 and 1; 2 is still open


@pytest.mark.slow
@frameworks
def test_lightning_with_a_plain_dataloader_says_its_checkpoints_lose_the_position(
    cat_dir, tmp_path
):
    """``DataLoader(ds, batch_size=None)`` instead of ``JobLoader(ds)`` (the pattern of every
    other loader): Lightning saves no job position, and the resume trains rows of epoch 1
    twice or never; the checkpoint and the resume each warn, once, with the fix."""
    common = ["--catalog", cat_dir, "--job", "l1_plain", "--out", tmp_path, "--plain-loader"]
    ckpt = tmp_path / "mid.ckpt"
    first = launch("lightning_run.py", *common, "--stop-after", 5, "--ckpt", ckpt)
    assert first.returncode == 0, first.stderr[-6000:]
    assert first.stderr.count(UNSAVED) == 1, first.stderr[-6000:]
    assert "Lightning saved a checkpoint without the position of job 'l1_plain'" in first.stderr
    assert "return JobLoader(ds) from train_dataloader()" in first.stderr
    resumed = launch("lightning_run.py", *common, "--resume", ckpt, "--tag", "resumed")
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert resumed.stderr.count(UNSAVED) == 1, resumed.stderr[-6000:]
    assert f"Lightning resumed from {ckpt} after batch 5 of epoch 0, but" in resumed.stderr
    epoch0 = recorded(tmp_path)[0]  # what the warning is about: not each row once
    assert len(epoch0) != len(set(epoch0)) or set(epoch0) != job_rows(cat_dir, "l1_plain")


@pytest.mark.slow
@frameworks
def test_lightning_ddp_two_processes_resumes_mid_epoch(cat_dir, tmp_path):
    """``devices=2, strategy="ddp"`` on CPU, Lightning's own launcher (rank 1 a child with
    ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``, no ``RANK``): each rank its share, the
    validation job padded, and a checkpoint at epoch 1 step 2 resumed by 2 fresh ranks."""
    rows, val_rows = job_rows(cat_dir, "ddp"), job_rows(cat_dir, "val")
    per_epoch = ROWS // (2 * BATCH)  # 6 batches a rank, 4 rows dropped
    ckpt = tmp_path / "mid.ckpt"
    common = ["--catalog", cat_dir, "--job", "ddp", "--val-job", "val", "--out", tmp_path]
    succeeds(
        "lightning_run.py", *common, "--devices", 2, "--stop-after", per_epoch + 2, "--ckpt", ckpt
    )
    assert len(recorded(tmp_path)[1]) == 2 * 2 * BATCH
    succeeds("lightning_run.py", *common, "--devices", 2, "--resume", ckpt, "--tag", "resumed")
    assert_two_epochs(tmp_path, rows, 2)
    assert {b["run"] for b in batches(tmp_path)} == {"first", "resumed"}
    assert_two_epochs(tmp_path, val_rows, 2, "val")


@pytest.mark.slow
@frameworks
def test_hf_trainer_under_torchrun_two_processes_resumes_mid_epoch(cat_dir, tmp_path):
    """``JobTrainer`` under ``torchrun --nproc_per_node 2``: ``num_train_epochs=2`` from the
    job's ``len()``, each process its share (not accelerate's dispatch or second split), the
    evaluation job each epoch, and ``train(resume_from_checkpoint=...)`` from step 6 + 2."""
    rows, val_rows = job_rows(cat_dir, "hf"), job_rows(cat_dir, "val")
    per_epoch = ROWS // (2 * BATCH)
    common = ["--catalog", cat_dir, "--job", "hf", "--val-job", "val", "--out", tmp_path]
    succeeds("hf_run.py", *common, "--stop-after", per_epoch + 2, torchrun=2)
    assert len(recorded(tmp_path)[1]) == 2 * 2 * BATCH
    ckpt = tmp_path / "hf" / f"checkpoint-{per_epoch + 2}"
    assert (ckpt / "tabloader_job.pt").exists()
    succeeds("hf_run.py", *common, "--resume", ckpt, "--tag", "resumed", torchrun=2)
    assert_two_epochs(tmp_path, rows, 2)
    assert_two_epochs(tmp_path, val_rows, 2, "val")


@pytest.mark.slow
@frameworks
def test_accelerate_under_torchrun_resumes_with_one_process(cat_dir, tmp_path):
    """accelerate's API under ``torchrun --nproc_per_node 2`` with ``prepare(accelerator,
    ds)``: each process its share on ``accelerator.device``, gradients synced on each
    epoch's last batch (``accumulate`` sees the end of the loader), and ``save_state`` at
    epoch 1 step 3 resumed by ``load_state`` in ONE process (N -> M ranks): the rest of
    epoch 1 once, then nothing more (2 epochs)."""
    rows = job_rows(cat_dir, "acc")
    per_epoch = ROWS // (2 * BATCH)  # 6 a rank: syncs at 4 (accumulation) and 6 (the end)
    ckpt = tmp_path / "state"
    common = ["--catalog", cat_dir, "--job", "acc", "--out", tmp_path]
    succeeds(
        "accelerate_run.py", *common, "--stop-after", per_epoch + 3, "--ckpt", ckpt, torchrun=2
    )
    first = batches(tmp_path)
    epoch0 = [b for b in first if b["epoch"] == 0]
    assert_epoch([i for b in epoch0 for i in b["ids"]], rows, 2)
    assert [b["synced"] for b in epoch0[:per_epoch]] == [False] * 3 + [True, False, True]
    succeeds("accelerate_run.py", *common, "--resume", ckpt, "--tag", "resumed")
    resumed = [b for b in batches(tmp_path) if b["run"] == "resumed"]
    assert {b["epoch"] for b in resumed} == {1}
    epoch1 = recorded(tmp_path)[1]
    done = 2 * 3 * BATCH  # 3 steps of 2 ranks before the checkpoint
    duplicates = [i for i, n in Counter(epoch1).items() if n > 1]
    assert not duplicates
    assert set(epoch1) <= rows
    assert len(epoch1) == done + trained(ROWS - done, 1)  # the rest, all on 1 rank


@pytest.mark.slow
@frameworks
def test_accelerates_own_prepare_fails_fast_naming_the_fix(cat_dir, tmp_path):
    """``accelerator.prepare(DataLoader(ds, batch_size=None))`` dispatches batches from
    process 0, so rank 1 never opens the job: rank 0 raises after the job's ``rank_timeout``
    with the fix, instead of waiting for ever."""
    common = ["--catalog", cat_dir, "--job", "acc_plain", "--out", tmp_path]
    result = launch("accelerate_run.py", *common, "--plain-prepare", torchrun=2)
    assert result.returncode != 0
    assert "LoaderError" in result.stderr, result.stderr[-4000:]
    assert "rank 0 waited 2 s for rank 1, which never opened the job" in result.stderr
    assert "tabloader.integrations.accelerate.prepare(accelerator, dataset)" in result.stderr


# -- in this process: the integrations' own bookkeeping and errors, no launcher ---------------


@pytest.fixture
def engine(image_cat_dir):
    """The engine in this process over 60 small images, job ``j``: 8 a batch, 8x8."""
    from tabloader.engine import Loader

    cat = catalog.open_catalog(image_cat_dir)
    cat.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (batch_size = 8, image_size = 8)")
    with Loader(cat, cache_bytes=8 << 20, workers=2) as loader:
        yield loader
    cat.close()


@pytest.fixture
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True, gradient_accumulation_steps=3)


def test_a_state_saved_with_torch_save_resumes_the_epoch(engine, tmp_path):
    """docs/frameworks.md's plain PyTorch checkpoint: ``torch.save`` of ``state_dict()`` beside the
    model's, ``torch.load`` (``weights_only``, its default) in the run that resumes."""
    from tabloader.torch import JobDataset

    rows = sorted(engine.catalog.job("j").ids)
    data = JobDataset("j", loader=engine)
    it = iter(data)
    seen = [i for _ in range(2) for i in next(it)["_id"].tolist()]
    torch.save(
        {"model": torch.nn.Linear(1, 1).state_dict(), "data": data.state_dict()}, tmp_path / "c"
    )
    data.close()
    again = JobDataset("j", loader=engine)
    again.load_state_dict(torch.load(tmp_path / "c")["data"])
    rest = [i for batch in again for i in batch["_id"].tolist()]
    assert sorted(seen + rest) == rows
    assert len(seen + rest) == len(rows)
    again.close()


def test_prepare_counts_the_batch_read_ahead_as_still_to_come(engine, accelerator):
    """accelerate's loader reads one batch ahead: a state saved after 3 trained batches gives
    the 4th again on resume, each row of the epoch once; the epoch's last batch is the end
    of the loader for ``accumulate``."""
    from tabloader.integrations.accelerate import prepare
    from tabloader.torch import JobDataset

    rows = sorted(engine.catalog.job("j").ids)
    data = JobDataset("j", loader=engine)
    loader = prepare(accelerator, data)
    assert len(loader) == len(data) == 8  # 60 rows: 7 batches of 8 and one of 4
    it = iter(loader)
    seen = [i for _ in range(3) for i in next(it)["_id"].tolist()]  # the 4th is read ahead
    state = loader.state_dict()
    assert accelerator._custom_objects[-1] is loader  # registered: save_state() carries it
    data.close()
    again = JobDataset("j", loader=engine)
    resumed = prepare(accelerator, again, register=False)
    resumed.load_state_dict(state)
    rest, synced = [], []
    for batch in resumed:
        with accelerator.accumulate(torch.nn.Linear(1, 1)):
            synced.append(accelerator.sync_gradients)
        rest += batch["_id"].tolist()
    assert sorted(seen + rest) == rows
    assert len(seen + rest) == len(rows)
    assert synced[-1]  # the epoch's last batch (5th of the resumed loop) syncs
    assert not synced[-2]
    assert resumed.state_dict()["stream"]["epoch"] == 1  # nothing read ahead at the end
    again.close()


def test_prepare_refuses_ranks_other_than_accelerates(engine, accelerator):
    """A dataset of rank 1 of 2 under a 1-process accelerate run (what torchrun on CPUs
    without ``Accelerator(cpu=True)`` gives) would train as if alone: refused, with the fix."""
    from torch.utils.data import DataLoader

    from tabloader.catalog._errors import LoaderError
    from tabloader.integrations.accelerate import prepare
    from tabloader.torch import JobDataset

    data = JobDataset("j", loader=engine, rank=1, world_size=2)
    with pytest.raises(
        LoaderError,
        match=r"JobDataset 'j' is rank 1 of 2, but this accelerate process is 0 of 1\. "
        r"accelerate runs one process: .*Accelerator\(cpu=True\).*"
        r"JobDataset\(job, rank=accelerator\.process_index",
    ):
        prepare(accelerator, data)
    with pytest.raises(
        TypeError, match=r"prepare\(\) takes a tabloader JobDataset, not DataLoader"
    ):
        prepare(accelerator, DataLoader(range(3)))


def test_a_checkpoint_without_the_jobs_position_says_how_to_resume(tmp_path):
    """A checkpoint of the plain ``Trainer`` holds no job position: resuming the job from
    it would replay or skip rows, so it is refused with the two ways out."""
    from tabloader.catalog._errors import LoaderError
    from tabloader.integrations.transformers import _load_state

    with pytest.raises(
        LoaderError,
        match=r"has no tabloader_job\.pt .* not saved by tabloader's JobTrainer.*"
        r"ignore_data_skip=True",
    ):
        _load_state(str(tmp_path))


def lightning_fit(data, loader, ckpt_dir, *, stop_after=None, resume=None) -> list:
    """Fit a tiny ``LightningModule`` on ``loader`` (over ``data``) in this process, one
    epoch, a checkpoint after step ``stop_after`` (then stop); the warnings it gave."""
    import warnings

    import lightning as L

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(1, 1)

        def train_dataloader(self):
            return loader

        def training_step(self, batch, batch_idx):
            return self.net(batch["label"].float()[:, None]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Stop(L.Callback):
        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == stop_after:
                trainer.save_checkpoint(ckpt_dir / "mid.ckpt")
                trainer.should_stop = True

    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[Stop()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Model(), ckpt_path=resume)
    data.close()
    return [str(w.message) for w in caught if "position" in str(w.message)]


def test_lightning_warns_once_when_a_plain_dataloader_leaves_the_jobs_position_out(
    engine, tmp_path
):
    """``DataLoader(ds, batch_size=None)`` from ``train_dataloader()``: the checkpoint holds
    no position of the job, and the resume starts the job's epoch anew; each says so, once,
    with the fix. A ``JobLoader`` says nothing."""
    from torch.utils.data import DataLoader

    from tabloader.torch import JobDataset, JobLoader

    data = JobDataset("j", loader=engine)
    warned = lightning_fit(data, DataLoader(data, batch_size=None), tmp_path, stop_after=2)
    assert len(warned) == 1, warned
    assert warned[0].startswith("Lightning saved a checkpoint without the position of job 'j'")
    assert "return JobLoader(ds) from train_dataloader()" in warned[0]

    data = JobDataset("j", loader=engine)
    resumed = lightning_fit(
        data, DataLoader(data, batch_size=None), tmp_path, resume=tmp_path / "mid.ckpt"
    )
    assert len(resumed) == 1, resumed
    assert resumed[0].startswith(
        f"Lightning resumed from {tmp_path / 'mid.ckpt'} after batch 2 of epoch 0, but the "
        "checkpoint holds no position of job 'j'"
    )
    assert "return JobLoader(ds) from train_dataloader()" in resumed[0]

    data = JobDataset("j", loader=engine)
    assert lightning_fit(data, JobLoader(data), tmp_path / "ok", stop_after=2) == []
    data = JobDataset("j", loader=engine)
    assert lightning_fit(data, JobLoader(data), tmp_path, resume=tmp_path / "ok" / "mid.ckpt") == []


def test_the_readmes_hf_recipe_says_what_cpus_need_as_hf_run_does():
    """On a machine without GPUs, torchrun's processes join one ``Trainer`` run only with
    ``use_cpu=True`` (each runs alone otherwise, and ``prepare`` refuses the dataset of a
    rank that accelerate does not know): the recipe in docs/frameworks.md says so, as its accelerate
    recipe says ``Accelerator(cpu=True)``, and ``hf_run.py`` (which the tests launch on CPUs)
    is that recipe: the same ``TrainingArguments``, with ``use_cpu=True``."""
    import ast

    page = (ROOT / "docs" / "frameworks.md").read_text()
    recipe = page.split("## Hugging Face Trainer\n", 1)[1].split("## accelerate\n", 1)[0]
    code = recipe.split("```python\n", 1)[1].split("```", 1)[0]
    assert "# on a machine without GPUs: TrainingArguments(..., use_cpu=True)" in code

    def training_arguments(source: str) -> dict[str, ast.expr]:
        (call,) = [
            node
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "TrainingArguments"
        ]
        return {k.arg: k.value for k in call.keywords if k.arg is not None}

    ours = training_arguments((SCRIPTS / "hf_run.py").read_text())
    assert ast.literal_eval(ours["use_cpu"]) is True
    assert set(training_arguments(code)) <= set(ours)  # the recipe's, run for real
