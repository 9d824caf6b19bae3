"""The loader's threads: a pool that runs the task of the earliest batch first.

A ``ThreadPoolExecutor`` runs tasks in the order they came. A loader's tasks come from several
batches at once (each job has ``prefetch`` of them in flight, and their look-ups run on the pool
too), so a later batch's decodes could go before those of the batch its job waits for: in a cold
service two look-ups ran side by side and the second batch's decodes were queued first, which held
the first batch back by a decode group (80 ms). Here each task has a priority, the order its batch
was cut in (:class:`~tabloader.engine._prepare.work.Work`'s ``seq``), and the earliest goes first;
tasks of one priority keep their order.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class PriorityPool:
    """``workers`` threads running submitted calls, the lowest ``priority`` first.

    Args:
        workers: the threads (started at the first submit).
        name: their names' prefix (``name_0``...).
    """

    def __init__(self, workers: int, name: str) -> None:
        self.workers, self._name = workers, name
        self._heap: list[tuple[int, int, Future[Any], Callable[..., Any], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, priority: int = 0) -> Future[Any]:
        """Run ``fn(*args)`` on a thread of the pool; its future.

        Raises:
            RuntimeError: the pool is shut down (as ``ThreadPoolExecutor`` raises it).
        """
        future: Future[Any] = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            heapq.heappush(self._heap, (priority, next(self._order), future, fn, args))
            if len(self._threads) < self.workers:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._cond.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more tasks; cancel those not started (``cancel_futures``); join the threads
        (``wait``) once they have run the rest."""
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for _, _, future, _, _ in self._heap:
                    future.cancel()
                self._heap.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap and not self._shutdown:
                    self._cond.wait()
                if not self._heap:
                    return
                _, _, future, fn, args = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
