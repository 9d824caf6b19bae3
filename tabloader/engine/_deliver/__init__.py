"""Delivered: each job's own batch, in this process or handed over to a service's client.

* ``handoff``: one handed-over batch (where each value lies, its wire encoding, its one copy
  out); ``collate``: the receivers that copy (or augment) values into the job's batch, or hand
  it over pinned (each owns its batches' pins);
* ``batchmem``: recycled memory for batches' image arrays;
* ``streams``: the :class:`Stream` protocol every consumer programs against; ``stream``: the
  consumer side in this process (``JobStream``) and a server's (``ServedStream``).
"""
