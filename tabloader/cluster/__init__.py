"""Several machines, on Ray: a leader samples for every job and places rows on the jobs' nodes.

``tabloader serve --ray`` runs a :class:`Cluster`: one :class:`Leader` actor per catalog
(the jobs and the dependent sampler; rows placed on the nodes of each job's ranks, in rounds
with lookahead) and one loader per node, which serves that node's ranks as the local service
does. :func:`serve_cluster` is that command; :func:`cluster_status` is ``tabloader status
--ray``; :func:`state_json` is the leader's checkpoint as the actor writes it.
"""

from __future__ import annotations

from tabloader.cluster._actor import (
    Cluster,
    ClusterStatus,
    cluster_status,
    serve_cluster,
    state_json,
)
from tabloader.cluster._leader import Leader

__all__ = ["Cluster", "ClusterStatus", "Leader", "cluster_status", "serve_cluster", "state_json"]
