"""Shared helpers of the tests of who wakes whom in the scheduler (engine and rank tests)."""

from __future__ import annotations

import threading


class CountingCondition(threading.Condition):
    """A condition that counts the notifications sent to it (``notify_all`` calls
    ``notify``), in the notifier's thread: no race with the waiter; and the threads that
    wait on it (``wait_for`` calls ``wait``)."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.notified = 0
        self.waiting = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting += 1  # the lock is held: no race with another waiter
        try:
            return super().wait(timeout)
        finally:
            self.waiting -= 1


def counting_waiter(group, stream) -> CountingCondition:
    """Replace the condition the stream's consumer waits on by one that counts notifications."""
    rank = stream.rank_state
    with group.cond:
        rank.cond = CountingCondition(group.lock)
    return rank.cond


def waiting(cond: CountingCondition) -> bool:
    """True once a thread waits on ``cond`` (not merely for its lock)."""
    return cond.waiting > 0


class Held(list):
    """The batches held back by :func:`held_for`; ``land(work)`` prepares one (it then lands)."""

    def __init__(self, submit) -> None:
        super().__init__()
        self.land = submit


def held_for(group, monkeypatch, name: str) -> Held:
    """The batches of job ``name`` never finish preparing: submitted, they are kept here."""
    submit = group.fetcher.submit
    held = Held(submit)

    def gate(work) -> None:
        if work.job.job.name == name:
            held.append(work)
        else:
            submit(work)

    monkeypatch.setattr(group.fetcher, "submit", gate)
    return held


def next_batch_in_thread(stream, outcome: list) -> threading.Thread:
    """A started (daemon) thread that waits for ``stream``'s next batch; what that raises is
    appended to ``outcome``."""

    def consume() -> None:
        try:
            stream.next_batch()
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    return thread
