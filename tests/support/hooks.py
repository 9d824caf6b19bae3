"""The private names of tabloader that tests may read, each with why a test needs it.

Tests go through the faces, and reach internals through private *modules* (whose names need no
underscore). Where a test must still read a private name, it is listed here, so one place says
what the tests are tied to. ``tests/test_private_reads.py`` fails on a read of any other private
name, on a hook no test reads, and on more than ``MAX_TEST_HOOKS`` hooks.
"""

from __future__ import annotations

MAX_TEST_HOOKS = 10

TEST_HOOKS: dict[str, str] = {
    # engine/_queue: JobQueues (the scheduler's queues)
    "_set_horizons": "set the lookahead horizons from made-up paces, and fail the scheduler",
    "_queue": "fail the queueing of one job's rows, to show the other jobs go on",
    # engine/_loader: Loader (a public class)
    "_pool": "hold work in flight in a loader's I/O pool while its service stops",
    # catalog/storage: DatasetReader (a public class) and the S3 store
    "_values": "see whether a reader indexed a part's values (a copying store leaves it None)",
    "_parts": "forget an S3 store's cached part files, so a reader reads the store afresh",
    # entry points
    "_client": "the status line of one client of the service (cli's status formats it)",
    "_load_state": "the transformers integration's refusal of a checkpoint without a position",
}
