"""Which data-parallel rank a stream is: from arguments, else from the launcher's environment.

torchrun (and Ray Train, DeepSpeed, Accelerate) set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE``. A job's ranks are numbered by ``RANK`` in ``0..WORLD_SIZE-1``; a
launcher of one machine that sets only ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (its ranks are
then all the ranks) is read from those. ``LOCAL_RANK`` set beside ``RANK`` is checked against
it, so a mixed-up environment fails at ``open`` instead of dealing two processes the same part
of every epoch.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from catalog.errors import LoaderError

__all__ = ["rank_share", "resolve_rank"]


def rank_share(rows: int, batch_size: int, world_size: int) -> int:
    """Rows each of ``world_size`` data-parallel ranks gets of an epoch of ``rows`` rows: all of
    them with one rank (its last batch may be short); else ``rows // (batch_size *
    world_size)`` full batches each, the last ``rows % (batch_size * world_size)`` rows
    dropped, as ``DistributedSampler(drop_last=True)`` does.
    """
    if world_size == 1:
        return rows
    return rows // (batch_size * world_size) * batch_size


def resolve_rank(rank: Any, world_size: Any) -> tuple[int, int]:
    """``(rank, world_size)``: as given, else from the environment (above), else ``(0, 1)``.

    Raises:
        LoaderError: one of the two given without the other, values that are not integers
            with ``0 <= rank < world_size``, or an environment that contradicts itself.
    """
    where = "rank and world_size"
    if rank is None and world_size is None:
        found = _from_environment()
        if found is None:
            return 0, 1
        rank, world_size, where = found
    elif rank is None or world_size is None:
        raise LoaderError(
            f"rank={rank!r}, world_size={world_size!r}: pass both (this stream is rank `rank` "
            "of `world_size` data-parallel ranks), or neither to read RANK and WORLD_SIZE "
            "from the environment."
        )
    _check(rank, world_size, where)
    return int(rank), int(world_size)


def _from_environment() -> tuple[int | str, int | str, str] | None:
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        rank_text, size_text = env[rank_var], env[size_var]
        if rank_text is None and size_text is None:
            continue
        if rank_text is None or size_text is None:
            raise LoaderError(
                f"The environment has {rank_var}={rank_text!r} and {size_var}={size_text!r}: "
                "set both (torchrun does) or neither, or pass rank= and world_size= to open()."
            )
        where = f"{rank_var} and {size_var} in the environment"
        rank, world_size = _env_int(rank_text), _env_int(size_text)
        _check(rank, world_size, where)
        if rank_var == "RANK" and env["LOCAL_RANK"] is not None:
            _check_local(int(rank), int(world_size), env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"])
        return rank, world_size, where
    return None


def _check_local(rank: int, world_size: int, local: str, local_size: str | None) -> None:
    """``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE``) must fit ``RANK`` and ``WORLD_SIZE``."""
    local_rank = _env_int(local)
    size = world_size if local_size is None else _env_int(local_size)
    where = "LOCAL_RANK and LOCAL_WORLD_SIZE in the environment"
    _check(local_rank, size, where)
    if int(local_rank) > rank or int(size) > world_size:
        raise LoaderError(
            f"The environment has LOCAL_RANK={local} and LOCAL_WORLD_SIZE={local_size} beside "
            f"RANK={rank} and WORLD_SIZE={world_size}: a process's rank on its machine cannot "
            "be above its rank in the job. Set RANK to the rank in the whole job (torchrun "
            "does), or pass rank= and world_size= to open()."
        )


def _check(rank: Any, world_size: Any, where: str) -> None:
    ok = all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in (rank, world_size)
    )
    if not ok or not 0 <= rank < world_size:
        raise LoaderError(
            f"rank={rank!r}, world_size={world_size!r} (from {where}): they must be integers "
            "with 0 <= rank < world_size; give each data-parallel rank its own rank from 0 to "
            "world_size - 1."
        )


def _env_int(text: str) -> int | str:
    """An integer from the environment, or the text as it was (to report it)."""
    try:
        return int(text)
    except ValueError:
        return text
