"""The loading engine: one process's pipeline, every job of it on one arena and one pool.

A module per step, in the order a row goes through them::

    sample -> queue -> fetch -> prepare -> arena -> collate -> stream

* **sample**: :mod:`tabloader.sampling` (beside this package: the dependent sampler is an
  algorithm of its own) picks which rows each job reads next;
* **queue**: :mod:`~tabloader.engine._queue.queues` turns the sampler's rounds into each job's queue
  of row ids and the future uses of each row (:mod:`~tabloader.engine._queue.uses`: the arena's
  eviction inputs); :mod:`~tabloader.engine._queue.scheduler` cuts the queues into batches and deals
  them to the ranks (:mod:`~tabloader.engine._queue.jobs`, :mod:`~tabloader.engine._queue.ranks`);
* **fetch**: :mod:`~tabloader.engine._prepare.fetch` prepares a batch (its records:
  :mod:`~tabloader.engine._prepare.work`): cheap columns gathered vectorized
  (:mod:`~tabloader.engine._prepare.gather`), images looked up in the arena, in-flight reads merged;
* **prepare**: the shared, deterministic prefix once per row for every job
  (:mod:`~tabloader.engine._prepare.prep`: decode, by the column's backend, chosen from
  :mod:`~tabloader.engine.decode`' registry; in :mod:`~tabloader.engine._prepare.decoding`'s
  processes or the pool's threads); each job's own rest on top
  (:mod:`~tabloader.engine._prepare.augment`, planned by :mod:`~tabloader.engine._prepare.planning`);
* **arena**: prepared values in slots of slabs of one buffer (:mod:`~tabloader.engine._arena.arena`,
  :mod:`~tabloader.engine._arena.slabs`), evicted by :mod:`~tabloader.engine._arena.eviction`'s policy, in
  shared memory with no name (:mod:`~tabloader.engine._arena.shm`: the layout and the reader/writer
  contract that the service and the decode processes rely on);
* **collate**: the batch laid out as a :class:`~tabloader.engine._deliver.handoff.HandedBatch` and
  received by its job's receiver, chosen when it opened (:mod:`~tabloader.engine._deliver.collate`):
  each value copied (or augmented) out of the arena into the job's own batch (the one
  ``copy_out``, memory from :mod:`~tabloader.engine._deliver.batchmem`), or handed over pinned to a
  service's client, which copies it out the same way; counted by
  :mod:`~tabloader.engine._arena.accounting`;
* **stream**: the consumer side (:mod:`~tabloader.engine._deliver.stream`, ``JobStream``).

:mod:`~tabloader.engine._loader` is the facade that wires them: :class:`Loader`. The service
(:mod:`tabloader.service`) runs one ``Loader`` for many processes; nothing here imports the
service, the cluster or the CLI.

The names below are imported on first use, so that a decode process importing
:mod:`tabloader.engine._prepare.decoding` does not import the whole engine (and DuckDB with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tabloader.engine._loader import JobStream, Loader, OnError, default_loader

__all__ = ["JobStream", "Loader", "OnError", "default_loader"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tabloader.engine import _loader as loader

        return getattr(loader, name)
    raise AttributeError(f"module 'tabloader.engine' has no attribute {name!r}")
