"""The records of a batch in preparation: a job's :class:`Plan` (how its columns are prepared)
and :class:`Work` (one batch of one job on its way through fetch, accounting and collate).

They live apart from :mod:`tabloader.engine._prepare.fetch` so that the modules the fetcher uses
(:mod:`tabloader.engine._arena.accounting`, :mod:`tabloader.engine._deliver.collate`) read them
without importing it back.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from tabloader.engine._prepare.augment import Augmenter
from tabloader.engine._prepare.prep import Decoder

_SEQ = itertools.count()


class Receiver(Protocol):
    """What becomes of a job's prepared batch, chosen once when the job opens (the two, in
    :mod:`tabloader.engine._deliver.collate`: copied out for a job of this process, or handed
    over pinned to a loader service's client). It owns the life of the batch's pins: what
    ``receive`` keeps pinned stays so until ``release``."""

    pins: bool  # the batch keeps its values pinned once received, until its client has it

    def receive(self, work: Work) -> Any:
        """The batch ``work`` prepared, as its job receives it (``Work.result``); the values
        it does not keep for the job are released."""

    def release(self, work: Work) -> None:
        """Let go of what a received batch holds (its client has it, or nobody will take
        it); a batch holds nothing after."""

    def open_already(self, job: str) -> str:
        """Why ``job``, open already, cannot be opened again with this receiver, and what
        to do."""


@dataclass(frozen=True)
class Plan:
    """How a job's columns are prepared: gathered, or decoded into an arena space (and then
    augmented for the job, when ``augment`` is set: every prepared column is an image); and
    who receives its batches (``receiver``)."""

    columns: tuple[str, ...]  # output order (``_id`` first, not listed)
    gathered: tuple[Decoder, ...]
    prepared: tuple[tuple[Decoder, int], ...]  # (decoder, arena space)
    augment: Mapping[str, Augmenter]  # by prepared column
    receiver: Receiver
    # where the job reads a shared decode larger than its own need, and from whom (said by
    # the open-time size check: ``jobs.fit_prefetch``; ``planning``)
    larger: tuple[str, ...] = ()


class Work:
    """One batch of one job in preparation (one Python object per batch, not per row)."""

    __slots__ = (
        "augment_s",
        "discard",
        "dropped",
        "epoch",
        "error",
        "errors",
        "gathered",
        "job",
        "loaded",
        "offsets",
        "plan",
        "private",
        "ready",
        "result",
        "rows",
        "seq",
        "shapes",
        "skip",
        "values",
        "waiting",
        "weights",
    )

    def __init__(
        self,
        job: Any,
        rows: npt.NDArray[np.int64],
        epoch: int,
        plan: Plan,
        *,
        skip: bool,
    ):
        self.job = job
        self.seq = next(_SEQ)  # cut order: the pool runs the earliest batch's tasks first
        self.rows = rows
        self.epoch = epoch
        self.plan = plan
        self.skip = skip
        self.values: dict[str, Any] = {}
        # a weighted job's ``_weight`` of each row (the dealer sets it); None: a plain job's
        self.weights: npt.NDArray[np.float32] | None = None
        self.gathered = False  # ``values`` were read (before the decodes, or after them)
        n = len(plan.prepared)
        self.offsets = [np.full(rows.size, -1, np.int64) for _ in range(n)]
        self.shapes = [np.zeros((rows.size, 3), np.int32) for _ in range(n)]
        self.private: dict[tuple[int, int], npt.NDArray[np.uint8]] = {}  # uncached values
        self.errors: dict[int, BaseException] = {}  # position -> the row's error
        self.error: BaseException | None = None  # the whole batch failed
        self.waiting = 1  # decode groups not landed yet, + 1 until the lookups are done
        self.loaded = 0  # values this batch read or decoded itself
        self.augment_s = 0.0  # seconds of the job's own augmentation in collate
        # prepared columns whose ``offsets`` are slots of the batch's own (its augmented
        # images, handed over by the service): freed on release, not unpinned
        self.discard: set[int] = set()
        # the receiver's: the job's batch (None: every row failed); a receiver that pins
        # makes a ``HandedBatch`` instead, which the scheduler passes on as it is
        self.result: dict[str, Any] | None = None
        self.ready = False  # set by the job's scheduler once ``on_done`` ran
        self.dropped = False  # its rank gave it up (``abandon``): released once it lands
