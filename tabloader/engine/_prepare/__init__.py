"""Fetched and prepared: a job's planned batch of row ids becomes prepared values.

* ``work``: the records of a batch in preparation; ``planning``: how a job's image columns are
  prepared (a fixed size, or a shared aspect-kept decode and the job's own augmentation);
* ``fetch``: one batch's preparation (arena look-ups, merged in-flight reads), on ``pool``'s
  threads; ``gather``: the cheap columns, vectorized;
* ``prep``: a column's :class:`~tabloader.engine._prepare.prep.Decoder` (decode backends:
  :mod:`tabloader.engine.decode`); ``imagesize``: an image's declared size before any decoder
  allocates; ``decoding``: the decode processes;
* ``augment`` and ``resample`` (with the C kernel ``_resample``): each job's own crops, resizes
  and flips.
"""
