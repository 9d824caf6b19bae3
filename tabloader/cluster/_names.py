"""How the processes of a Ray cluster find each other: the namespace and names of the actors.

The leader's name is derived from the catalog's resolved path (:func:`leader_name`), so every
process of the cluster that knows the catalog finds the same leader (:func:`get_leader`), and
each node's loader is named after the leader and its node (:func:`loader_name`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import xxhash

NAMESPACE = "tabloader"
"""The Ray namespace of the leader actors (named actors are found within a namespace)."""


def leader_name(catalog: str | os.PathLike[str]) -> str:
    """The actor name of the leader of ``catalog``: ``tabloader-leader-<hash of its path>``."""
    path = str(Path(catalog).expanduser().resolve())
    return f"tabloader-leader-{xxhash.xxh64_hexdigest(path.encode())[:12]}"


def get_leader(catalog: str | os.PathLike[str]) -> Any:
    """The running leader actor of ``catalog``.

    Raises:
        ValueError: no leader runs for ``catalog`` (Ray's error: start one with
            :func:`start_leader`).
    """
    import ray

    return ray.get_actor(leader_name(catalog), namespace=NAMESPACE)


def node_key(node: str) -> str:
    """The short form of a Ray node id used in paths and actor names."""
    return node[:16]


def loader_name(catalog_root: str | os.PathLike[str], node: str) -> str:
    """The actor name of ``node``'s loader for the catalog."""
    return f"{leader_name(catalog_root).replace('leader', 'loader')}-{node_key(node)}"
