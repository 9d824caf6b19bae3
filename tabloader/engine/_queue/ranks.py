"""Which data-parallel rank a stream is: from arguments, else from whatever launched it.

A job's ranks are numbered ``0..world_size-1``. Every launcher says so in its own way; the
first source below that is there answers, explicit arguments first:

====  ==========================================  ============================================
 #    source                                      set by
====  ==========================================  ============================================
 1    ``rank=`` and ``world_size=`` (both)        the user: ``JobDataset(rank=...,
                                                  world_size=...)``, ``Loader.open``
 2    torch.distributed's default process group,  Lightning (``strategy="ddp"``, any cluster),
      initialised: ``get_rank()``,                accelerate and the HF Trainer under a
      ``get_world_size()``                        launcher, DeepSpeed, Ray Train, a user's
                                                  ``init_process_group``
 3    accelerate's process state of more than    accelerate / the HF Trainer on TPUs, where
      one process, with no process group:         torch_xla numbers the processes and no
      ``process_index``, ``num_processes``        process group is initialised
 4    ``RANK`` and ``WORLD_SIZE``                 torchrun, ``accelerate launch``, the HF
                                                  Trainer under those, Ray Train's
                                                  ``TorchTrainer``, DeepSpeed, Kubeflow
 5    ``LOCAL_RANK``, ``WORLD_SIZE`` and          Lightning's own launcher (``Trainer(devices
      ``NODE_RANK`` (default 0), no ``RANK``      =2)``); it sets them in the process that
                                                  runs the script too, which is rank 0
 6    ``SLURM_PROCID`` and ``SLURM_NTASKS``,      ``srun`` (its tasks as the ranks)
      more than one task
 7    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``     a launcher of one machine
 8    nothing                                     a plain job: rank 0 of 1
====  ==========================================  ============================================

Why this order: a process group, once initialised, is what DDP averages over, so it is the
truth; a launcher's variables say what it meant to start and are read only before one is
(a ``JobDataset`` opens at its first ``iter()``; Lightning initialises the group before it
builds the dataloaders). torch and accelerate are read only when this process imported them
already: nothing here imports torch (the engine and the service do not).

- Lightning's launcher (5): the rank is ``NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``. It
  does not set ``LOCAL_WORLD_SIZE``, so on a node other than 0 without it the rank is
  unknown and open fails (let the Trainer initialise torch.distributed first, or pass
  ``rank=``).
- accelerate's state (3) adds only TPUs: on GPUs and CPUs accelerate initialises a process
  group for more than one process (2); its state of one process says nothing a plain job
  does not, and it lingers after the run (a notebook, a test session) to contradict a later
  launch.
- SLURM's variables describe ``srun``'s tasks: torchrun (or any launcher that sets ``RANK``)
  inside a task wins over them, and one task (``SLURM_NTASKS=1``: an ``sbatch`` script, a
  launcher inside one task) says nothing about ranks. A script that an ``sbatch --ntasks=N``
  script runs directly (not with ``srun``) still sees ``SLURM_NTASKS=N``: run it with
  ``srun``, or pass ``rank=``.

Sources that are there together must agree, or open fails with one ``LoaderError`` that lists
every launcher variable it saw and what each source says, instead of dealing two processes
the same part of every epoch: the process group (or accelerate's state) against ``RANK`` and
``WORLD_SIZE`` or Lightning's variables, and ``LOCAL_RANK`` (``LOCAL_WORLD_SIZE``) against the
rank (world size) found, which they cannot exceed. SLURM's variables are never held against
the others (torchrun inside ``srun`` numbers its own ranks). Partial or stale variables beside
a process group are not an error (Lightning deletes ``WORLD_SIZE`` after ``fit`` and keeps
``LOCAL_RANK``); without one, a pair set by halves is.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import numpy as np

from tabloader.catalog._errors import LoaderError
from tabloader.catalog._settings import SETTINGS

WORLD_SIZE_MAX = int(SETTINGS["world_size"].bounds()[1])
"""The most data-parallel ranks a job has (``tabloader.catalog._settings``' ``world_size``); a job
has at
most one rank per row too (checked where the job is opened)."""

#: The environment variables read here, in the order an error lists them.
VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)

# The sources, as errors name them.
PROCESS_GROUP = "torch.distributed's process group"
ACCELERATE = "accelerate's process state"
TORCHRUN = "RANK and WORLD_SIZE (torchrun, accelerate launch, Ray Train, DeepSpeed)"
LIGHTNING = "LOCAL_RANK, NODE_RANK and WORLD_SIZE (Lightning's launcher)"
SLURM = "SLURM_PROCID and SLURM_NTASKS (srun)"
LOCAL = "LOCAL_RANK and LOCAL_WORLD_SIZE (a launcher of one machine)"

FIX = (
    "Pass rank= and world_size= to JobDataset(rank=..., world_size=...) (or Loader.open, "
    "RemoteLoader.open): explicit values win over the launcher; or fix the launcher's "
    "environment."
)


def rank_share(rows: int, batch_size: int, world_size: int, drop_last: bool = True) -> int:
    """Rows each of ``world_size`` data-parallel ranks gets of an epoch of ``rows`` rows: all of
    them with one rank (its last batch may be short). With several: ``rows // (batch_size *
    world_size)`` full batches each, the last ``rows % (batch_size * world_size)`` rows
    dropped, as ``DistributedSampler(drop_last=True)`` does; or, without ``drop_last``,
    ``ceil(rows / world_size)`` each, the last batch of each rank maybe short and up to
    ``world_size - 1`` rows repeated to pad the shares, as ``DistributedSampler(drop_last=False)``
    does (the scheduler repeats the epoch's first rows).
    """
    if world_size == 1:
        return rows
    if not drop_last:
        return -(-rows // world_size)
    return rows // (batch_size * world_size) * batch_size


class _Found(NamedTuple):
    """What one source says: rank ``rank`` (None: unknown) of ``world_size``."""

    rank: int | None
    world_size: int
    source: str

    def says(self) -> str:
        rank = "an unknown rank" if self.rank is None else f"rank {self.rank}"
        return f"{rank} of {self.world_size} from {self.source}"


def resolve_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """``(rank, world_size)``: as given, else from the launcher (the table above), else
    ``(0, 1)``. Runs at every open: cheap (a few environment look-ups).

    Raises:
        LoaderError: one of the two given without the other, values that are not integers
            with ``0 <= rank < world_size``, or launchers that contradict each other.
    """
    if rank is None and world_size is None:
        return _from_launcher()
    if rank is None or world_size is None:
        raise LoaderError(
            f"rank={rank!r}, world_size={world_size!r}: pass both (this stream is rank `rank` "
            "of `world_size` data-parallel ranks), or neither to find them from the launcher "
            "(torch.distributed, RANK and WORLD_SIZE, ...: see tabloader.engine._queue.ranks)."
        )
    _check(rank, world_size, "rank and world_size")
    return int(rank), int(world_size)


def _from_launcher() -> tuple[int, int]:
    env = {name: os.environ[name] for name in VARIABLES if name in os.environ}
    process = _from_process()
    if process is None:
        found = _from_environment(env, None) if env else None
        if found is None:
            return 0, 1
    else:
        found, told = process, _from_environment(env, process)
        if told is not None and (
            told.world_size != found.world_size or told.rank not in (None, found.rank)
        ):
            raise _disagree(env, process, f"{found.says()}, but {told.says()}")
    assert found.rank is not None  # only a cross-check leaves it unknown
    if "LOCAL_RANK" in env and found.source != LOCAL:
        _check_local(found, env, process)
    return found.rank, found.world_size


def _from_process() -> _Found | None:
    """Sources 2 and 3: this process's initialised process group, else accelerate's state of
    several processes (TPUs); only from modules imported already."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return _Found(int(dist.get_rank()), int(dist.get_world_size()), PROCESS_GROUP)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        shared = state.PartialState._shared_state  # empty until PartialState() is made
        rank, size = shared.get("process_index"), shared.get("num_processes")
        if isinstance(rank, int) and isinstance(size, int) and size > 1:
            return _Found(rank, size, ACCELERATE)
    return None


def _from_environment(env: dict[str, str], process: _Found | None) -> _Found | None:
    """Sources 4 to 7 (the first whose variables are set), None if none is. With a process
    group or accelerate state (``process``) this is only held against it: a source that
    cannot answer then answers nothing, and SLURM's and the one-machine pair are not read."""
    if "RANK" in env or ("WORLD_SIZE" in env and "LOCAL_RANK" not in env):
        return _pair(env, "RANK", "WORLD_SIZE", TORCHRUN, process)
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:
        return _lightning(env, process)
    if process is not None:
        return None
    if env.get("SLURM_NTASKS", "1") != "1":
        return _pair(env, "SLURM_PROCID", "SLURM_NTASKS", SLURM, None)
    if "LOCAL_RANK" in env or "LOCAL_WORLD_SIZE" in env:
        return _pair(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE", LOCAL, None)
    return None


def _pair(
    env: dict[str, str], rank_var: str, size_var: str, source: str, process: _Found | None
) -> _Found | None:
    rank_text, size_text = env.get(rank_var), env.get(size_var)
    if rank_text is None or size_text is None:
        if process is not None:
            return None  # half a pair beside a process group: stale, not read
        raise _disagree(
            env,
            None,
            f"{rank_var}={rank_text!r} and {size_var}={size_text!r}: set both (the launcher "
            "does) or neither",
        )
    rank, world_size = _env_int(rank_text), _env_int(size_text)
    _check(rank, world_size, source, env, process)
    return _Found(int(rank), int(world_size), source)


def _lightning(env: dict[str, str], process: _Found | None) -> _Found:
    """Lightning's launcher: ``LOCAL_RANK`` on node ``NODE_RANK`` of ``WORLD_SIZE`` ranks."""
    names = ("WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
    values = [_env_int(env.get(name, "0")) for name in names]
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, int):
            raise _disagree(env, process, f"{name}={value!r} is not an integer")
    world_size, local, node, per_node = (int(v) for v in values)
    if per_node == 0 and node != 0:
        if process is not None:  # the process group knows: hold its world size against this
            return _Found(None, world_size, LIGHTNING)
        raise _disagree(
            env,
            None,
            f"NODE_RANK={node} without LOCAL_WORLD_SIZE: Lightning's launcher does not say "
            "how many ranks each machine runs, so this process's rank in the job is unknown "
            "until the Trainer initialises torch.distributed (it does before it builds the "
            "dataloaders: open the dataset after that), or set LOCAL_WORLD_SIZE",
        )
    rank = node * per_node + local
    _check(rank, world_size, LIGHTNING, env, process)
    return _Found(rank, world_size, LIGHTNING)


def _check_local(found: _Found, env: dict[str, str], process: _Found | None) -> None:
    """``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE``) must fit the rank and world size found."""
    assert found.rank is not None
    local = _env_int(env["LOCAL_RANK"])
    size = _env_int(env.get("LOCAL_WORLD_SIZE", str(found.world_size)))
    both = isinstance(local, int) and isinstance(size, int)
    if both and (int(local) > found.rank or int(size) > found.world_size):
        raise _disagree(
            env,
            process,
            f"{found.says()}, beside LOCAL_RANK={local} and LOCAL_WORLD_SIZE="
            f"{env.get('LOCAL_WORLD_SIZE')}: a process's rank on its machine cannot be above "
            "its rank in the job, nor the ranks on a machine more than the job's",
        )
    _check(local, size, LOCAL, env, process)


def _disagree(env: dict[str, str], process: _Found | None, problem: str) -> LoaderError:
    """One error for a launcher environment that contradicts itself: what is wrong, every
    launcher variable seen, and the fix."""
    seen = [f"{name}={env[name]}" for name in VARIABLES if name in env]
    if process is not None:
        seen.insert(0, f"{process.source}: rank {process.rank} of {process.world_size}")
    return LoaderError(
        f"This process's data-parallel rank is unclear: {problem}. Seen: "
        f"{'; '.join(seen) or 'nothing'}. {FIX}"
    )


def _check(
    rank: Any,
    world_size: Any,
    where: str,
    env: dict[str, str] | None = None,
    process: _Found | None = None,
) -> None:
    ok = all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (rank, world_size)
    )
    if ok and 0 <= rank < world_size <= WORLD_SIZE_MAX:
        return
    problem = (
        f"rank={rank!r}, world_size={world_size!r} (from {where}): they must be integers "
        f"with 0 <= rank < world_size <= {WORLD_SIZE_MAX} (the most ranks a job has)"
    )
    if env is not None:
        raise _disagree(env, process, problem)
    raise LoaderError(
        f"{problem}; give each data-parallel rank its own rank from 0 to world_size - 1."
    )


def _env_int(text: str) -> int | str:
    """An integer from the environment, or the text as it was (to report it)."""
    try:
        return int(text)
    except ValueError:
        return text
