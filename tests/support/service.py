"""A loader service of a test's own: started as ``tabloader serve`` in a child, and asked for
statements; the processes under it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import tabloader
from tabloader.catalog import ServiceError
from tabloader.service._client import RemoteLoader
from tests.support.polling import TIMEOUT, wait_for

__all__ = ["TIMEOUT", "descendants", "rows_of", "sql", "start_service"]


def start_service(
    root: Path, *extra: str, new_session: bool = False, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``tabloader serve`` in the foreground of a child (of its own process group, as a
    terminal's, with ``new_session``; with ``env`` added to its environment), once it answers."""
    log = root.parent / "serve.log"
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tabloader", "--catalog", str(root), "serve"),
                *("--workers", "2", "--cache-bytes", str(16 << 20), *extra),
            ],
            stderr=err,
            start_new_session=new_session,
            env={**os.environ, **(env or {})},
        )

    def answers() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            with RemoteLoader(root, start=False) as remote:
                remote.wait_ready()  # its decode processes run (they start lazily)
        except ServiceError:
            return False
        return True

    try:
        wait_for(answers, "the service to answer")
    except AssertionError:
        proc.kill()
        raise
    return proc


def sql(remote: RemoteLoader, statement: str) -> Any:
    """A statement run in the service of ``remote``'s catalog (``tabloader.connect``)."""
    with tabloader.connect(remote.root) as cat:
        assert cat.service_pid == remote.service_pid
        return cat.sql(statement)


def rows_of(remote: RemoteLoader, where: str) -> list[int]:
    table = sql(remote, f"SELECT _id FROM imgs WHERE {where} ORDER BY _id")
    return table.column("_id").to_pylist()


def descendants(pid: int) -> set[int]:
    """The processes under ``pid`` (its forkserver and the decode processes forked from it)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True, check=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines()[1:]:
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found
