"""Cached: the arena of prepared values, shared by every job (and, in the service, every process).

* ``slabs``: one buffer cut into slabs of equal-size slots; ``arena``: values in slots, pinned
  while a batch holds them; ``eviction``: which value makes room (next use, then uses);
* ``shm``: the arena in shared memory with no name, and its reader/writer contract;
* ``accounting``: what the engine counts of the work done, and the arena's access log.
"""
