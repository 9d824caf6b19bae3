"""The loading engine: one process's pipeline, every job of it on one arena and one pool.

A module per step, in the order a row goes through them::

    sample -> queue -> fetch -> prepare -> arena -> collate -> stream

* **sample**: :mod:`tabloader.sampling` (beside this package: the dependent sampler is an
  algorithm of its own) picks which rows each job reads next;
* **queue**: :mod:`~tabloader.engine.queues` turns the sampler's rounds into each job's queue
  of row ids and the future uses of each row (:mod:`~tabloader.engine.uses`: the arena's
  eviction inputs); :mod:`~tabloader.engine.scheduler` cuts the queues into batches and deals
  them to the ranks (:mod:`~tabloader.engine.jobs`, :mod:`~tabloader.engine.ranks`);
* **fetch**: :mod:`~tabloader.engine.fetch` prepares a batch (its records:
  :mod:`~tabloader.engine.work`): cheap columns gathered vectorized
  (:mod:`~tabloader.engine.gather`), images looked up in the arena, in-flight reads merged;
* **prepare**: the shared, deterministic prefix once per row for every job
  (:mod:`~tabloader.engine.prep`: decode, by the column's backend, chosen from
  :mod:`~tabloader.engine.backends`' registry; in :mod:`~tabloader.engine.decoding`'s
  processes or the pool's threads); each job's own rest on top
  (:mod:`~tabloader.engine.augment`, planned by :mod:`~tabloader.engine.planning`);
* **arena**: prepared values in slots of slabs of one buffer (:mod:`~tabloader.engine.arena`,
  :mod:`~tabloader.engine.slabs`), evicted by :mod:`~tabloader.engine.eviction`'s policy, in
  shared memory with no name (:mod:`~tabloader.engine.shm`: the layout and the reader/writer
  contract that the service and the decode processes rely on);
* **collate**: the batch laid out as a :class:`~tabloader.engine.handoff.HandedBatch` and
  received by its job's receiver, chosen when it opened (:mod:`~tabloader.engine.collate`):
  each value copied (or augmented) out of the arena into the job's own batch (the one
  ``copy_out``, memory from :mod:`~tabloader.engine.batchmem`), or handed over pinned to a
  service's client, which copies it out the same way; counted by
  :mod:`~tabloader.engine.accounting`;
* **stream**: the consumer side (:mod:`~tabloader.engine.stream`, ``JobStream``).

:mod:`~tabloader.engine.loader` is the facade that wires them: :class:`Loader`. The service
(:mod:`tabloader.service`) runs one ``Loader`` for many processes; nothing here imports the
service, the cluster or the CLI.

The names below are imported on first use, so that a decode process importing
:mod:`tabloader.engine.decoding` does not import the whole engine (and DuckDB with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tabloader.engine.loader import JobStream, Loader, OnError, default_loader

__all__ = ["JobStream", "Loader", "OnError", "default_loader"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tabloader.engine import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'tabloader.engine' has no attribute {name!r}")
