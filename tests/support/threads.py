"""Ranks (or jobs) on threads of the test's process: each a callable; a hang or an exception in
any fails the test."""

from __future__ import annotations

import threading

__all__ = ["JOIN_S", "epochs_of", "run_threads"]

JOIN_S = 60.0  # a hang guard, not a speed check


def run_threads(targets) -> None:
    """Run each callable on its own thread; a hang or an exception fails the test."""
    errors: list[BaseException] = []

    def guard(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guard(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a rank is still running (hang)"
    if errors:
        raise errors[0]


def epochs_of(stream, epochs: int, out: list[list[list[int]]]) -> None:
    """Read ``epochs`` epochs of ``stream``: out[epoch] = the ids of each batch."""
    for epoch in range(epochs):
        assert stream.epoch == epoch
        out.append([b["_id"].tolist() for b in stream.iter_epoch()])
