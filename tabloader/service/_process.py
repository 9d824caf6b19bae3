"""A foreground service in a child process, with its caller's cache and workers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabloader.catalog._errors import ServiceError
from tabloader.service._client import RemoteLoader

if TYPE_CHECKING:
    from typing_extensions import Self

START_TIMEOUT_S = 120.0  # interpreter start-up on a loaded 2-core machine


class ServiceProcess:
    """``tabloader --catalog ROOT serve`` in a child process, once its decode processes run.

    Started by its caller (``tabloader analyze``, a benchmark, a test harness; not auto-started
    by a client, which stops by itself when idle) so that its cache and workers are the
    caller's, and stopped with SIGTERM by ``stop()`` or at the end of a ``with`` (after which
    its ``access_log``, if asked for, is written).

    Args:
        root: the catalog directory.
        cache_bytes: the service's cache (``serve --cache-bytes``).
        workers: its decode workers (``serve --workers``).
        log: the file its output goes to (quoted in the error if it does not start).
        access_log: record the engine's look-ups and releases there (``serve --access-log``).

    Raises:
        ServiceError: it exited, or did not answer within ``START_TIMEOUT_S``.
    """

    def __init__(
        self,
        root: Path,
        *,
        cache_bytes: int,
        workers: int,
        log: Path,
        access_log: Path | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "tabloader", "--catalog", str(self.root), "serve"),
                    *("--cache-bytes", str(cache_bytes), "--workers", str(workers)),
                    *(() if access_log is None else ("--access-log", str(access_log))),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:
                    with RemoteLoader(self.root, start=False) as remote:
                        remote.wait_ready()  # its decode processes too, as the threads mode's
                    return
                except ServiceError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                        raise ServiceError(
                            f"The service for {self.root} did not start (its log {log}): "
                            + " | ".join(tail)
                        ) from None
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise

    def stats(self) -> dict[str, Any]:
        """The service's engine counters (``decodes``, ``reads``...)."""
        remote = RemoteLoader(self.root, start=False)
        try:
            return remote.stats()
        finally:
            remote.close()

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after a minute)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
