"""Several machines: a leader samples for every job and places rows on the jobs' nodes.

* :mod:`tabloader.cluster._placement` - which rank (node) reads each sampled row (pure numpy);
* :mod:`tabloader.cluster._leader` - the leader: jobs, the dependent sampler, per-node work
  lists in rounds with lookahead, acknowledgements and a checkpoint; and its Ray actor.
"""

from __future__ import annotations

from tabloader.cluster._leader import Assignment, Leader, WorkList
from tabloader.cluster._placement import DROPPED, JobPlacement, Placer

__all__ = ["DROPPED", "Assignment", "JobPlacement", "Leader", "Placer", "WorkList"]
