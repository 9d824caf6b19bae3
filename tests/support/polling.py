"""The one way a test waits for something: poll a predicate until it holds or a deadline passes.

The deadline is a hang guard, never a speed check: a regression that never gets there fails
the test with ``what`` instead of holding the suite until pytest-timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable

TIMEOUT = 60.0


def wait_for(
    predicate: Callable[[], object], what: str = "a condition", timeout: float = TIMEOUT
) -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.01)
