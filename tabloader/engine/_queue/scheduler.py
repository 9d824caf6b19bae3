"""Per-dataset scheduling: sampling rounds -> each job's queue of row ids -> batches to prepare.

Data flow, per dataset::

    scheduler thread: sample_many(every job with room below its horizon)
        -> rows queued per job as arrays (row, round, epoch)
    a job's first ``prefetch`` batches are cut from its queue and handed to the Fetcher
        -> Work (one per batch) -> gathered, looked up / decoded in the arena, collated
    the job's consumer takes its next finished batch (``take``)

* **Rounds and queues** (who takes part in a round, a job's own pace, what jobs give back
  when another opens, the future uses of each row): :mod:`tabloader.engine._queue.queues`.
* **Epochs.** Batches never straddle an epoch; the last batch of an epoch may be short.
* **Ranks (DDP).** The ranks of a data-parallel job are one job (one queue, one entry in the
  sampler: it shares with every other job); each rank is a
  :class:`~tabloader.engine._queue.jobs.RankState`, a plain job has one. Batches are cut from the
  job's queue as above and dealt round-robin,
  the k-th of an epoch to rank ``k % world_size``; the rows past the last full turn (the
  last in the sampler's order) are dropped, or with ``drop_last = false`` dealt in a last
  turn of shorter batches padded with the epoch's first rows (see
  :mod:`tabloader.engine._queue.jobs`). Nothing is sampled or dealt before every rank has opened
  (a rank's state is made as it opens: a world that never comes costs nothing); a rank that
  waits ``rank_timeout`` seconds for a rank that never opened raises. Lockstep: batches
  are cut only while the rank whose turn it is has room below ``prefetch``, so a rank ahead
  waits for the slow one and at most ``prefetch`` batches per rank are in flight. A rank
  that left has its turns dropped, unprepared.
* **Row sources and receivers.** Where a job's rows come from and who receives its batches
  were chosen when it opened (:mod:`tabloader.engine._queue.sources`,
  :mod:`tabloader.engine._deliver.collate`); this module calls them and never asks which. On a
  node of a Ray cluster the leader samples for every job (:mod:`tabloader.cluster`): each rank
  there is a job of its own here, *fed*: :meth:`DatasetScheduler.feed` queues the rows and
  rounds the leader sent; it takes no part in the rounds, and once its source fails (the
  cluster job is gone) it raises the reason when it would wait for rows.

A job's and a rank's state (positions, counters): :mod:`tabloader.engine._queue.jobs`; its queue:
:mod:`tabloader.engine._queue.jobqueue`; the cutting and dealing of its batches, and its
``state_dict``: :mod:`tabloader.engine._queue.dealer` (one
:class:`~tabloader.engine._queue.dealer.Dealer` a job, in ``dealers``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._errors import LoaderError
from tabloader.engine._deliver.streams import no_importance
from tabloader.engine._prepare.fetch import Fetcher
from tabloader.engine._prepare.work import Work
from tabloader.engine._queue.dealer import Dealer
from tabloader.engine._queue.jobs import MAX_UNDELIVERED, FedRows, JobState, OnError, RankState
from tabloader.engine._queue.queues import JobQueues

logger = logging.getLogger(__name__)

ABANDONED_CHECK_S = 1.0  # how often an idle scheduler looks for streams dropped without close()


class DatasetScheduler:
    """One dataset's jobs, their batches and its scheduling thread.

    Args:
        name: the dataset.
        num_rows: rows of the dataset version read.
        queues: the dataset's jobs, samplers, queues and future uses (empty).
        fetcher: prepares the batches.
        close_job: how the owner closes a job whose streams were all dropped without close().
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        queues: JobQueues,
        fetcher: Fetcher,
        *,
        close_job: Callable[[JobState], None],
    ) -> None:
        self.name = name
        self.num_rows = num_rows
        self.queues = queues
        self.jobs = queues.jobs  # the open jobs, by name (``queues`` adds and removes them)
        self.fetcher = fetcher
        self.dealers: dict[JobState, Dealer] = {}  # each open job's (one a job, by identity)
        self._close_job = close_job
        # One lock for everything above; ``cond`` (on it) is where the scheduling thread
        # waits, each rank's ``cond`` (on it too) where that rank's consumer waits: a landed
        # batch wakes its own consumer only, not every consumer of the dataset (on few cores
        # the herd of wakeups cost more than the batches). Re-entrant: a batch of cheap
        # columns is prepared inline under the lock and lands (``landed``) there too.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.closed = False
        self.error: BaseException | None = None
        # (job, row) skips already logged: a bad row is skipped again every epoch (at once:
        # the fetcher remembers it), and a warning line each time was most of what a job
        # beside 20 bombs cost its neighbours (``python -m benchmarks hostile``)
        self._logged_skips: set[tuple[str, int | None]] = set()
        self.thread = threading.Thread(
            target=self._run, name=f"tabloader-sched-{name}", daemon=True
        )
        self.thread.start()

    def grow(self, num_rows: int) -> None:
        """The dataset has ``num_rows`` rows now (appended ones have no uses yet)."""
        with self.cond:
            self.queues.grow(num_rows)
            self.num_rows = num_rows

    # -- jobs ------------------------------------------------------------------------------------
    def add(
        self, job: JobState, *, remaining: BitMap | None, epoch: int, rank: int = 0
    ) -> RankState:
        """Open ``job``, fresh or resumed (``remaining`` rows of epoch ``epoch``), as ``rank``.

        If a job of that name is open already with ``job.world_size`` ranks, ``rank`` joins
        it instead (``job`` only carries the options, which must be the same).

        Raises:
            LoaderError: the job is open already (as a plain job, or that rank), or with
                another world size, other options or another state.
        """
        with self.cond:
            current = self.jobs.get(job.name)
            if current is not None:
                return self._attach_locked(current, job, rank, remaining, epoch)
            resumed = None if remaining is None else (epoch, BitMap(remaining))
            self.queues.open(job, remaining=remaining, epoch=epoch)
            self.dealers[job] = Dealer(
                job,
                pop=functools.partial(self.queues.pop, job),
                submit=self._submit,
                resumed=resumed,
            )
            joined = job.open_rank(rank, self.lock)
            self._activate_locked(job)  # a resumed job's rows drawn already (``drawn``)
            self.cond.notify()  # a round for the new job
            return joined

    def feed(self, job: JobState, sent: FedRows) -> None:
        """Queue the rows a leader sent the fed ``job`` (:meth:`JobQueues.feed`) and start
        preparing its batches.

        Raises:
            LoaderError: the job is not fed, or the leader and this node disagree on its
                epochs or weights.
        """
        with self.cond:
            if job.closed or (job.epochs is not None and sent.epoch >= job.epochs):
                return  # past the epochs the job reads: nothing to load
            self.queues.feed(job, sent)
            self._activate_locked(job)
            self._wake_job(job)

    def fail(self, job: JobState, reason: str) -> None:
        """The fed ``job``'s source fails (its cluster job is gone): its rank raises
        ``reason`` once it would wait for rows (the batches it has go on being delivered)."""
        with self.cond:
            job.source.fail(reason)
            self._wake_job(job)

    def lost(self, rank: RankState, who: str, undelivered: int = 0) -> None:
        """``rank``'s process ended without close(): it is dropped (``leave``), and the job's
        other ranks fail with ``who`` at their next batch of the epoch it died in, or of the
        one after the epoch whose whole share it had (they finish that one). A rank that
        has read its last epoch, or the job's only rank, just leaves. ``undelivered``: as for
        ``state_dict``."""
        with self.cond:
            job = rank.job
            if job.world_size > 1 and not (rank.closed or job.gone or rank.finished()):
                done = rank.share_done(undelivered)
                if done is None:
                    epoch = rank.position(undelivered)[0]
                    job.gone, job.gone_from = f"{who} died mid-epoch {epoch}", epoch
                else:
                    job.gone, job.gone_from = f"{who} ended after epoch {done}", done + 1
            self._leave_locked(rank)

    def _attach_locked(
        self, job: JobState, asked: JobState, rank: int, remaining: BitMap | None, epoch: int
    ) -> RankState:
        """Rank ``rank`` joins the open ``job``; ``asked`` has the options it was opened with."""
        job.joining(asked, rank)
        self.dealers[job].check_state(rank, remaining, epoch)
        joined = job.open_rank(rank, self.lock)
        self._wake_job(job)  # every rank may have been waiting for this one
        self.cond.notify()  # the last one: the job's first round
        return joined

    def remove(self, job: JobState) -> None:
        """Close ``job`` (every rank): its queued rows and remaining uses go, the sampler
        forgets it."""
        with self.cond:
            self._remove_locked(job)

    def _remove_locked(self, job: JobState) -> None:
        if job.closed:
            return
        job.closed = True
        for r in job.ranks.values():
            r.closed = True
            self._drop_batches(r)
        self.queues.close(job)
        del self.dealers[job]
        self._wake_job(job)  # a consumer waiting in take() raises: closed

    def _drop_batches(self, rank: RankState) -> None:
        """Forget a closed rank's batches. Ready ones are released by their receiver here;
        those still preparing release their pins when they land (``landed``)."""
        for work in rank.batches:
            if work.ready:
                work.plan.receiver.release(work)
        rank.batches.clear()

    def leave(self, rank: RankState) -> None:
        """Close one rank: the job goes on with the others (and leaves with the last).

        The batches dealt to the rank from now on are dropped unprepared, so the others never
        wait for it: a rank that leaves mid-epoch loses its share of that epoch.
        """
        with self.cond:
            self._leave_locked(rank)

    def _leave_locked(self, rank: RankState) -> None:
        if rank.closed:
            return
        job = rank.job
        rank.closed = True
        self._drop_batches(rank)
        if not any(r.is_open() for r in job.ranks.values()):
            self._remove_locked(job)
            return
        self._trim_log_locked(job)
        self._activate_locked(job)  # it may have been that rank's turn
        self._wake_job(job)  # that rank (closed: its take() raises), and the others: all_joined
        self._poke(job)

    def score(self, space: int, rows: npt.NDArray[np.int64]) -> tuple[Any, Any]:
        """The arena's eviction inputs: (round of next queued use, future uses) per row.

        A row of a batch cut and submitted but not yet looked up (so not pinned yet) is
        counted as a use due before every queued one (round -1). A job drawing with
        replacement adds its expected draws of the row (:meth:`JobQueues.expected`).
        """
        n, u = self.queues.future.of(space, rows)
        expected = self.queues.expected(space, rows)
        if expected is not None:  # weighted jobs' draws beyond what they sampled (SHADE)
            u = u + expected
        starting = self.fetcher.starting(space, rows)
        if starting.any():
            n[starting > 0] = -1
            u += starting
        return n, u

    # -- the scheduling thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    # dropped ranks first: the other ranks of their jobs may wait for them
                    self._close_abandoned_locked()
                    while not self.closed and not any(j.hungry() for j in self.jobs.values()):
                        if self._close_abandoned_locked():
                            continue
                        self.cond.wait(ABANDONED_CHECK_S)
                    if self.closed:
                        return
                    for job, exc in self.queues.sample():
                        self._fail_locked(job, exc)
                    for job in list(self.jobs.values()):
                        self._activate_locked(job)  # their batches wake them as they land
        except BaseException as exc:  # not one job's: surfaces in every consumer of the dataset
            logger.exception("scheduler of %s failed", self.name)
            with self.cond:
                self.error = exc
                self._wake_all()

    def _close_abandoned_locked(self) -> bool:
        """Close the ranks whose streams were dropped without close(); False if none."""
        found = False
        for job in list(self.jobs.values()):
            gone = [r for r in job.ranks.values() if r.abandoned and not r.closed]
            if not gone:
                continue
            found = True
            for r in gone:
                logger.warning(
                    "job %s: its stream was dropped without close(); closing it", r.label()
                )
            if all(r.abandoned for r in job.ranks.values() if r.is_open()):
                self._close_job(job)
            else:
                for r in gone:
                    self._leave_locked(r)
        return found

    def _activate_locked(self, job: JobState) -> None:
        """Deal the job's next batches (``Dealer.deal``); a job closed has none. An error
        there is the job's own: it fails that job (``_fail_locked``)."""
        dealer = self.dealers.get(job)
        if dealer is not None:
            try:
                dealer.deal()
            except Exception as exc:
                self._fail_locked(job, exc)

    def _fail_locked(self, job: JobState, exc: BaseException) -> None:
        """``job``'s own sampling, queueing or dealing raised ``exc``: the job fails, and
        only it. It leaves (its queue, its rows in the sampler, its batches), every rank of
        it raises the reason at its next call (one line; the traceback is logged once, here),
        and the dataset's other jobs go on; the job can be opened again."""
        if job.closed:
            return
        logger.error(
            "job %r of dataset %r failed; the other jobs go on",
            job.name,
            self.name,
            exc_info=exc,
        )
        job.failed = (
            f"Job {job.name!r} failed in the loader ({type(exc).__name__}: {str(exc)[:200]}); "
            f"the other jobs of dataset {self.name!r} go on. Open the job again (from a "
            "state_dict() to resume)."
        )
        try:
            self._remove_locked(job)
        except Exception:  # what it holds may be half made: what could be freed is
            logger.exception("job %r: leaving after its failure failed too", job.name)
            job.closed = True
            self.jobs.pop(job.name, None)
            self.dealers.pop(job, None)
            self._wake_job(job)

    def _submit(self, work: Work) -> None:
        """Start preparing a batch dealt (the fetcher is looked up at each batch: a test may
        hold its batches back)."""
        self.fetcher.submit(work)

    def _trim_log_locked(self, job: JobState) -> None:
        """Let the job's dealer forget the batches every rank is past."""
        dealer = self.dealers.get(job)
        if dealer is not None:
            dealer.trim_log()

    def landed(self, work: Work) -> None:
        """The fetcher finished ``work`` (the Fetcher's ``on_done``): its rank may take it."""
        with self.cond:
            rank: RankState = work.job
            rank.loaded += work.loaded + work.rows.size * len(work.plan.gathered)
            rank.decoded += work.loaded
            work.ready = True
            if work.dropped or rank.closed:  # nobody takes it (its epoch was abandoned)
                work.plan.receiver.release(work)
            elif rank.batches and rank.batches[0] is work:  # what its consumer waits for
                rank.cond.notify_all()

    # -- the consumer side -------------------------------------------------------------------------
    def take(self, rank: RankState, epoch: int | None) -> Any:
        """The rank's next batch (as its receiver received it), or None at the end of
        ``epoch`` (if given) or of the last epoch.

        A batch whose rows were all skipped is not returned: the next one of its epoch is.
        Its consumer's stalls are timed by the stream it takes from (``JobStream``; a service's
        client times its own).
        """
        job = rank.job
        while True:
            t0 = time.perf_counter()
            with self.cond:
                while True:
                    self._check(rank)
                    if rank.finished() or (epoch is not None and rank.next_epoch() != epoch):
                        return None
                    if job.gone_from is not None and rank.next_epoch() >= job.gone_from:
                        self._raise_gone(rank)
                    if rank.batches and rank.batches[0].ready and job.all_joined():
                        work = rank.batches.popleft()
                        break
                    if not rank.batches:
                        self._activate_locked(job)
                        if not rank.batches:
                            job.source.check_going(job)  # a fed job's leader may be gone
                        if rank.batches:  # dealt now, maybe prepared here already: its
                            continue  # wake-up came before this wait
                    self._poke(job)
                    self._wait_locked(rank, t0)
                rank.taken += 1
                job.pace.add(int(work.rows.size))
                job.measure_regime()
                self._trim_log_locked(job)
                self._activate_locked(job)
                self._poke(job)  # room for the scheduler
            batch = self._deliver(rank, work)
            if batch is not None:
                return batch

    def abandon(self, rank: RankState, epoch: int, ahead_rows: int = 0) -> int:
        """Give up the rest of ``epoch`` for ``rank`` (a new ``iter()`` of a job whose last
        one stopped mid-epoch): its batches of that epoch, ready or preparing, are dropped,
        and those not yet dealt are dropped unprepared as they are cut, so the rank's next
        batch is the first of the next epoch. Other jobs and other ranks are untouched (each
        rank of a data-parallel job gives up its own share). ``ahead_rows``: rows of a batch
        already taken that its consumer dropped (a service client's batch read ahead).

        Returns the rows given up (counted in the rank's ``abandoned_rows``); 0 when the rank
        is past ``epoch`` already.
        """
        job = rank.job
        with self.cond:
            before = rank.abandoned_rows
            rank.abandoned_rows += ahead_rows
            rank.abandoning = epoch
            try:
                while not rank.finished() and rank.next_epoch() == epoch:
                    self._check(rank)
                    if job.gone_from is not None and epoch >= job.gone_from:
                        self._raise_gone(rank)
                    while rank.batches and rank.batches[0].epoch == epoch:
                        self._drop(rank.batches.popleft())
                    if rank.next_epoch() != epoch:
                        break
                    self._activate_locked(job)  # deals the epoch's rest: dropped unprepared
                    if rank.next_epoch() != epoch:
                        break
                    self._poke(job)
                    rank.cond.wait(0.1)  # woken as its batches are dealt (and dropped)
            finally:
                rank.abandoning = None
            self._trim_log_locked(job)
            self._activate_locked(job)
            self._poke(job)
            given_up = rank.abandoned_rows - before
        if given_up:
            logger.info(
                "job %s abandoned %d rows of epoch %d (a new iteration starts the next epoch)",
                rank.label(),
                given_up,
                epoch,
            )
        return given_up

    def _drop(self, work: Work) -> None:
        """Drop a batch of its rank's abandoned epoch (the caller holds the lock)."""
        rank: RankState = work.job
        rank.give_up(int(work.rows.size))
        if not work.ready:
            work.dropped = True  # ``landed`` releases what it holds
        else:
            work.plan.receiver.release(work)

    @staticmethod
    def _raise_gone(rank: RankState) -> None:
        """Raise why the rank's job is gone (a rank of it died)."""
        job = rank.job
        raise LoaderError(
            f"Job {rank.label()} lost a rank: {job.gone}. Every rank of a data-parallel job "
            "reads each epoch together; start every rank again (from a state_dict to resume)."
        )

    def report(
        self, rank: RankState, ids: npt.NDArray[np.int64], losses: npt.NDArray[np.float64]
    ) -> None:
        """Hand per-row losses of a batch of ``rank`` to its job's source
        (``RowSource.report``: its sampler's ``report``), under the lock its rounds are drawn
        under; every rank of a job reports to the job's one entry there.

        Raises:
            LoaderError: the job was not opened with ``importance = 'loss'``, the rank is
                closed, the job is fed (its leader takes its reports: the service forwards
                there), or the sampler refused the rows (not the job's).
        """
        job = rank.job
        if job.spec.importance != "loss":
            raise no_importance(job.name)
        with self.cond:
            self._check(rank)
            job.source.report(job, ids, losses)

    def _wait_locked(self, rank: RankState, since: float) -> None:
        """Wait for news (``since``: when the rank's ``take`` began to wait).

        No rank gets a batch before every rank has opened (as DDP's init_process_group waits
        for every rank), so a rank that never opens would hold up the others forever: a rank
        that has waited ``rank_timeout`` seconds for one raises. A rank that opened but is
        slow is waited for as long as it takes.

        Raises:
            LoaderError: ``rank_timeout`` seconds passed with a rank not opened yet.
        """
        job = rank.job
        if rank.closed or self.error is not None:  # (its job failed meanwhile): ``_check``
            return
        if job.all_joined():
            rank.cond.wait()
            return
        waited = time.perf_counter() - since
        if waited < job.spec.rank_timeout:
            rank.cond.wait(job.spec.rank_timeout - waited)
            return  # ``take`` looks again, and comes back here if it must still wait
        missing = job.missing()
        logger.warning(
            "job %r: rank %d waited %.0f s for rank(s) %s, which never opened the job; it raises",
            job.name,
            rank.rank,
            waited,
            _listed(missing),
        )
        raise LoaderError(_never_opened(job.name, rank.rank, missing, waited))

    def _deliver(self, rank: RankState, work: Work) -> dict[str, Any] | None:
        if work.error is not None:
            raise work.error
        job = rank.job
        if work.errors:
            first = work.errors[min(work.errors)]
            if job.on_error is OnError.RAISE:
                raise first
            rank.skipped += len(work.errors)
            for e in work.errors.values():
                key = (rank.label(), getattr(e, "row_id", None))
                if key[1] is None or key not in self._logged_skips:  # once a job and row
                    self._logged_skips.add(key)
                    logger.warning("job %s skipped a row: %s", rank.label(), e)
        rank.augment_s += work.augment_s
        return work.result

    def _check(self, rank: RankState) -> None:
        if rank.job.failed is not None:
            raise LoaderError(rank.job.failed)
        if rank.closed:
            raise LoaderError(f"Job stream {rank.label()} is closed; open the job again.")
        if self.error is not None:
            raise LoaderError(
                f"The scheduler of dataset {self.name!r} failed: {self.error!r}"
            ) from self.error

    def state_dict(self, rank: RankState, undelivered: int = 0) -> dict[str, Any]:
        """Where the job is at this rank's step: its epoch and the rows of that epoch that
        are not in the batches every rank had taken at that step.

        Ranks that save at the same step get the same state, however far the others are.
        The step is ``undelivered`` batches before the last the rank took (a service's client
        holds one it read ahead).
        """
        job = rank.job
        sampler = job.source.progress(job)  # raises where the progress is kept elsewhere
        if not 0 <= undelivered <= MAX_UNDELIVERED or isinstance(undelivered, bool):
            raise LoaderError(
                f"{undelivered!r} batches taken but not trained on: a state_dict counts 0 to "
                f"{MAX_UNDELIVERED} (the batch a framework fetched ahead, and a service "
                "client's batch read ahead)."
            )
        with self.cond:
            self._check(rank)
            state = self.dealers[job].state(rank, sampler, undelivered)
            if job.spec.importance == "loss":  # a resume draws from its scores
                scores = sampler.importance_scores(job.name)
                if scores is not None:
                    state["importance"] = scores.state_dict()
            return state

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self._wake_all()
        self.thread.join()
        self.fetcher.gatherer.close()

    # -- wakeups (under the lock) ------------------------------------------------------------------
    def _poke(self, job: JobState) -> None:
        """Wake the scheduling thread if ``job`` wants a round, or has a rank whose stream was
        dropped (the others may wait for it; the thread also polls for those)."""
        if job.hungry() or any(r.abandoned and not r.closed for r in job.ranks.values()):
            self.cond.notify()

    def _wake_job(self, job: JobState) -> None:
        """Wake every rank of ``job``: one closed, opened or left (``take`` checks again)."""
        for r in job.ranks.values():
            r.cond.notify_all()

    def _wake_all(self) -> None:
        """Wake everybody: the scheduler failed or closes."""
        self.cond.notify_all()
        for job in self.jobs.values():
            self._wake_job(job)


def _never_opened(job: str, rank: int, missing: list[int], waited: float) -> str:
    """Why rank ``rank`` of ``job`` stops waiting for the ``missing`` ranks, and the fixes."""
    them = f"rank {missing[0]}, which" if len(missing) == 1 else f"ranks {_listed(missing)}, which"
    return (
        f"job {job!r}: rank {rank} waited {waited:.0f} s for {them} never opened the job. "
        "Every rank must iterate its own JobDataset. Under accelerate (and the HF Trainer), "
        "accelerate dispatches batches from process 0 by default: use "
        "tabloader.integrations.accelerate.prepare(accelerator, dataset) instead of "
        "accelerator.prepare(DataLoader(dataset)), and "
        "tabloader.integrations.transformers.JobTrainer instead of Trainer; or the other "
        "rank's process did not start "
        "/ uses another world_size. Raise rank_timeout to wait longer (a job option, e.g. "
        "JobDataset(..., rank_timeout=120) or WITH (rank_timeout = 120))."
    )


def _listed(ranks: list[int], most: int = 8) -> str:
    """``ranks`` for a message: the first ``most``, then how many more."""
    shown = ", ".join(map(str, ranks[:most]))
    return shown if len(ranks) <= most else f"{shown} and {len(ranks) - most} more"
