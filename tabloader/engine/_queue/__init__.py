"""Sampled and queued: each open job's rows, from the sampler's rounds to batches for its ranks.

* ``queues``: a dataset's open jobs and their queues of row ids, filled by sampling rounds;
* ``uses``: the future uses of each row (the arena's eviction inputs);
* ``jobqueue``: one job's queue; ``dealer``: its batches cut and dealt to its ranks;
* ``jobs``: what the scheduler keeps of each open job (and the ``RowSource`` protocol);
  ``sources``: where a job's rows come from (this loader's sampler, or a leader that feeds
  them), chosen when it opens; ``ranks``: which rank a stream is;
* ``scheduler``: per dataset, rounds -> queues -> batches to prepare.
"""
