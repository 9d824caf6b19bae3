"""Shared helpers of the tests of who wakes whom in the scheduler (engine and rank tests)."""

from __future__ import annotations

import threading


class CountingCondition(threading.Condition):
    """A condition that counts the notifications sent to it (``notify_all`` calls
    ``notify``), in the notifier's thread: no race with the waiter."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def counting_waiter(group, stream) -> CountingCondition:
    """Replace the condition the stream's consumer waits on by one that counts notifications."""
    rank = stream._rank
    with group.cond:
        rank.cond = CountingCondition(group.lock)
    return rank.cond


def waiting(cond) -> bool:
    """True once a thread waits on ``cond`` (not merely for its lock)."""
    return len(cond._waiters) > 0


def held_for(group, monkeypatch, name: str) -> list:
    """The batches of job ``name`` never finish preparing: submitted, they are kept here
    (``group.fetcher._start(work)`` prepares one; it then lands)."""
    held: list = []
    submit = group.fetcher.submit

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
