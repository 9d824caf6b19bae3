"""Regions: the dependent sampling structure behind :class:`DependentSampler`.

Every row that at least one job still needs in its current epoch lives in exactly one
*region*, keyed by the exact set of jobs that still need it (a bitmask of job slots).
``R_j`` is the union of the regions whose key holds ``j``; ``refcount(row)`` is the
popcount of its region's key.

Mapping onto JOADER's dependent sampling tree
---------------------------------------------
JOADER (NeurIPS'22, Algorithm 1) sorts the jobs of a round by ``|R_j|`` ascending,
``j_0 .. j_{m-1}``, and keeps a binary tree: the **root** holds the rows all jobs need
(``∩ R_j``), the **right leaf** under it holds the smallest job's difference
(``R_{j_0} - root``), and the **left subtree** is the same tree built for the remaining
jobs ``j_1 .. j_{m-1}`` over what is left. Here the tree is not stored; it is a *view*
of the regions for a given order (:meth:`Regions.groups`):

* a region's *level* ``d(K) = 1 + max{t : j_t ∉ K}`` (0 if ``K`` holds every job);
  ``levels[0]`` is the root, ``levels[1..s]`` together with the root is the node
  ``∩_{t≥s} R_{j_t}`` reached by walking ``s`` steps down the left spine;
* ``dec[t]`` (regions holding ``j_t`` with level ``> t``) is the right leaf hanging at
  depth ``t``: ``R_{j_t}`` minus everything the walk already passed (``S | I``).

Picking a row for jobs ``P`` moves it from region ``K`` to ``K - P``; that move is the
paper's "compensation" of the other nodes. A join splits every region by the new set, a
leave merges ``K`` into ``K - j``, and a new epoch for job ``j`` moves ``D_j``'s rows
into regions with ``j``; no other job's rows are touched, so nobody loses or repeats a row.

Rows of a region are kept in an ``array('I')`` with a global position index, so removing
a row is an O(1) swap-remove and a uniform pick is one index: every row is equally
likely (the public prototype weighted 128-row blocks equally, a bias bug).

Memory is O(max row id) for the position index (dataset ids are dense ``0..N-1``) plus
O(union) for the rows. Per-round cost is O(number of regions that the round's jobs share
with each other) for the first round of a new job order; the per-order view is cached.
"""

from __future__ import annotations

import array
import itertools
import logging

import numpy as np

from tabloader.sampling._states import RegionsState

logger = logging.getLogger(__name__)

_Groups = tuple[list[list[int]], list[list[int]]]


class Regions:
    """A partition of the rows still due into regions keyed by job bitmask.

    Attributes:
        keys: Region id to job bitmask (``0`` for a retired, empty region).
        rows: Region id to its rows (``array('I')``), in pick order.
        index: Job bitmask to region id.
        pos: Row id to its position in its region.
        reg: Row id to its region id, ``-1`` if no job needs the row.
    """

    CACHE_SIZE = 32

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.rows: list[array.array[int]] = []
        self.index: dict[int, int] = {}
        self.pos: array.array[int] = array.array("I")
        self.reg: array.array[int] = array.array("i")
        self._cache: dict[tuple[int, ...], _Groups] = {}

    # ------------------------------------------------------------------ helpers
    def _grow(self, size: int) -> None:
        """Make ``pos`` and ``reg`` cover row ids ``< size``."""
        n = len(self.reg)
        if size > n:
            self.pos.frombytes(bytes(4 * (size - n)))
            self.reg.frombytes(b"\xff" * (4 * (size - n)))

    def region(self, key: int) -> int:
        """Return the id of the region for ``key``, creating it if needed."""
        r = self.index.get(key)
        if r is not None:
            return r
        r = len(self.keys)
        self.keys.append(key)
        self.rows.append(array.array("I"))
        self.index[key] = r
        for order, (levels, dec) in self._cache.items():
            self._place(order, r, key, levels, dec)
        return r

    def move(self, row: int, new_key: int) -> None:
        """Move ``row`` from its region to the region of ``new_key`` (0: drop it)."""
        pos, reg = self.pos, self.reg
        arr = self.rows[reg[row]]
        p = pos[row]
        last = arr.pop()
        if last != row:
            arr[p] = last
            pos[last] = p
        if new_key:
            t = self.index.get(new_key)
            if t is None:
                t = self.region(new_key)
            a2 = self.rows[t]
            pos[row] = len(a2)
            a2.append(row)
            reg[row] = t
        else:
            reg[row] = -1

    # ------------------------------------------------------------------ bulk ops
    def add_bit(self, ids: np.ndarray, bit: int) -> None:
        """Add job ``bit`` to the key of every row in ``ids`` (sorted unique uint32)."""
        if len(ids) == 0:
            return
        self._grow(int(ids[-1]) + 1)
        reg = np.frombuffer(self.reg, dtype=np.int32)
        cur = reg[ids]
        cuts = np.flatnonzero(cur[1:] != cur[:-1]) + 1
        groups: list[tuple[int, np.ndarray]]
        if len(cuts) <= 256:  # few runs (ranges, nested sets): group the runs, no sort
            starts = [0, *cuts.tolist()]
            ends = [*cuts.tolist(), len(ids)]
            runs: dict[int, list[np.ndarray]] = {}
            for a, b in zip(starts, ends, strict=True):
                runs.setdefault(int(cur[a]), []).append(ids[a:b])
            groups = [
                (r, parts[0] if len(parts) == 1 else np.concatenate(parts))
                for r, parts in sorted(runs.items())
            ]
        else:
            # numpy's stable sort is a radix sort for 16-bit keys: ~5x faster than on int32
            keys16 = (cur + 1).astype(np.uint16) if len(self.keys) < 0xFFFF else cur
            order = np.argsort(keys16, kind="stable")
            cur_sorted = cur[order]
            bounds = np.flatnonzero(cur_sorted[1:] != cur_sorted[:-1]) + 1
            starts_a = np.concatenate(([0], bounds))
            ends_a = np.concatenate((bounds, [len(ids)]))
            groups = [
                (int(cur_sorted[a]), ids[order[a:b]]) for a, b in zip(starts_a, ends_a, strict=True)
            ]
        del reg
        self._cache.clear()
        for r, rows in groups:
            if r < 0:
                self.append(self.region(bit), rows)
                continue
            key = self.keys[r]
            new_key = key | bit
            if len(rows) == len(self.rows[r]) and new_key not in self.index:
                del self.index[key]
                self.keys[r] = new_key
                self.index[new_key] = r
                continue
            self._remove(r, rows)
            self.append(self.region(new_key), rows)

    def drop_bit(self, bit: int) -> None:
        """Remove job ``bit`` from every key (the job leaves): merge ``K`` into ``K - bit``."""
        self._cache.clear()
        for r, key in enumerate(list(self.keys)):
            if not key & bit:
                continue
            new_key = key & ~bit
            rows = self.rows[r]
            if new_key and new_key not in self.index:
                del self.index[key]
                self.keys[r] = new_key
                self.index[new_key] = r
                continue
            data = np.frombuffer(rows, dtype=np.uint32).copy() if len(rows) else None
            self.rows[r] = array.array("I")
            if data is not None:
                if new_key:
                    self.append(self.index[new_key], data)
                else:
                    np.frombuffer(self.reg, dtype=np.int32)[data] = -1
            del self.index[key]
            self.keys[r] = 0
        self.compact()

    def append(self, r: int, rows: np.ndarray) -> None:
        """Put ``rows`` (in no region) at the end of region ``r``."""
        arr = self.rows[r]
        start = len(arr)
        arr.frombytes(rows.astype(np.uint32, copy=False).tobytes())
        np.frombuffer(self.pos, dtype=np.uint32)[rows] = np.arange(
            start, start + len(rows), dtype=np.uint32
        )
        np.frombuffer(self.reg, dtype=np.int32)[rows] = r

    def pick(self, r: int, idx: np.ndarray) -> np.ndarray:
        """Swap-remove the row at position ``idx[0]`` of region ``r``, then ``idx[1]``...

        ``idx[j]`` must be ``< len(rows[r]) - j``. Returns the picked rows (int64); their
        ``pos`` and ``reg`` entries are left for the caller to set.
        """
        arr = self.rows[r]
        size = len(arr)
        a = np.frombuffer(arr, dtype=np.uint32)
        picks = swap_remove(a, np.frombuffer(self.pos, dtype=np.uint32), idx)
        del a
        del arr[size - len(idx) :]
        return picks

    def _remove(self, r: int, rows: np.ndarray) -> None:
        """Swap-remove ``rows`` (all in region ``r``) in O(k log k)."""
        arr = self.rows[r]
        n, k = len(arr), len(rows)
        a = np.frombuffer(arr, dtype=np.uint32)
        pos = np.frombuffer(self.pos, dtype=np.uint32)
        p = pos[rows].astype(np.int64)
        cut = n - k
        in_tail = np.zeros(k, dtype=bool)
        in_tail[p[p >= cut] - cut] = True
        holes = np.sort(p[p < cut])
        fillers = np.flatnonzero(~in_tail) + cut
        if len(holes):
            moved = a[fillers]
            a[holes] = moved
            pos[moved] = holes
        del a, pos
        del arr[cut:]

    def compact(self) -> None:
        """Drop empty regions and renumber the rest (invalidates cached views)."""
        live = [r for r, rows in enumerate(self.rows) if len(rows)]
        if len(live) == len(self.rows):
            return
        self._cache.clear()
        remap = np.full(len(self.rows) + 1, -1, dtype=np.int32)
        remap[live] = np.arange(len(live), dtype=np.int32)
        reg = np.frombuffer(self.reg, dtype=np.int32)
        reg[:] = remap[reg]  # -1 indexes the trailing -1
        self.keys = [self.keys[r] for r in live]
        self.rows = [self.rows[r] for r in live]
        self.index = {k: i for i, k in enumerate(self.keys)}

    # ------------------------------------------------------------------ queries
    def groups(self, order: tuple[int, ...]) -> _Groups:
        """The dependent sampling tree of ``order`` (job slots, ``|R_j|`` ascending).

        Returns:
            ``(levels, dec)``: ``levels[s]`` are the regions of level ``s`` (``s < m``) and
            ``dec[t]`` the regions holding ``order[t]`` at a level ``> t``.
        """
        hit = self._cache.get(order)
        if hit is not None:
            return hit
        if len(self._cache) >= self.CACHE_SIZE:
            self._cache.clear()
        m = len(order)
        levels: list[list[int]] = [[] for _ in range(m)]
        dec: list[list[int]] = [[] for _ in range(m)]
        for r, key in enumerate(self.keys):
            if key:
                self._place(order, r, key, levels, dec)
        self._cache[order] = (levels, dec)
        return levels, dec

    @staticmethod
    def _place(
        order: tuple[int, ...],
        r: int,
        key: int,
        levels: list[list[int]],
        dec: list[list[int]],
    ) -> None:
        m = len(order)
        t = m - 1
        while t >= 0 and key >> order[t] & 1:
            t -= 1
        d = t + 1
        if d < m:
            levels[d].append(r)
        for s in range(d):
            if key >> order[s] & 1:
                dec[s].append(r)

    def members(self, bit: int) -> np.ndarray:
        """All rows whose key holds ``bit`` (unsorted uint32)."""
        parts = [
            np.frombuffer(rows, dtype=np.uint32)
            for key, rows in zip(self.keys, self.rows, strict=True)
            if key & bit and len(rows)
        ]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)

    def refcounts(self, ids: np.ndarray) -> np.ndarray:
        """How many jobs still need each row of ``ids`` (vectorized)."""
        ids = np.asarray(ids, dtype=np.int64)
        pc = np.array([k.bit_count() for k in self.keys] + [0], dtype=np.int64)
        out = np.zeros(len(ids), dtype=np.int64)
        ok = (ids >= 0) & (ids < len(self.reg))
        out[ok] = pc[np.frombuffer(self.reg, dtype=np.int32)[ids[ok]]]
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> RegionsState:
        """Keys and rows (in pick order) of every region, empty ones included.

        Region ids fix the order in which a pick walks the regions, so they are kept.
        """
        return {
            "keys": list(self.keys),
            "rows": [rows.tobytes() for rows in self.rows],
            "size": len(self.reg),
        }

    def load_state_dict(self, state: RegionsState) -> None:
        """Rebuild from :meth:`state_dict` output."""
        self.__init__()  # type: ignore[misc]
        self._grow(int(state["size"]))
        for r, (key, data) in enumerate(zip(state["keys"], state["rows"], strict=True)):
            self.keys.append(int(key))
            self.rows.append(array.array("I"))
            if key:
                self.index[int(key)] = r
            rows = np.frombuffer(data, dtype=np.uint32)
            if len(rows):
                self.append(r, rows)


def swap_remove(rows: np.ndarray, pos: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Pick ``rows[idx[0]]``, then ``rows[idx[1]]``... each by a swap-remove, vectorized.

    Pick ``j`` sees ``size - j`` rows (``size = len(rows)``): it takes the row at ``idx[j]``
    (``< size - j``) and moves the last one, at ``t_j = size - 1 - j``, into its slot
    (``pos`` follows). The caller drops the last ``len(idx)`` rows afterwards.

    Pick ``j`` never reads a slot already popped (``idx[j] <= t_j < t_i`` for ``i < j``),
    so it only sees an earlier pick ``i``'s change when it reads the slot ``i`` refilled:
    ``idx[j] == idx[i]`` (same slot) or ``t_j == idx[i]`` (its filler was picked). Picks
    without such a conflict inside a chunk read the chunk-start array, write distinct slots
    and move distinct fillers, so a chunk applies as a few array operations; a chunk ends
    at its first conflict. With ``n`` picks from ``size`` rows there are about
    ``n² / size`` conflicts, hence chunks.

    Returns:
        The picked rows (int64), in pick order; bit-identical (also ``rows`` and ``pos``)
        to the picks applied one by one.
    """
    n = len(idx)
    size = len(rows)
    picks = np.empty(n, dtype=np.int64)
    bounds = [*chunk_starts(idx, size).tolist(), n]
    for c, e in itertools.pairwise(bounds):
        at = idx[c:e]
        got = rows[at]
        fillers = rows[size - e : size - c][::-1]  # t_c, ..., t_{e-1}
        rows[at] = fillers  # picking the last row writes it onto itself
        pos[fillers] = at  # ... and its own position
        picks[c:e] = got
    return picks


def chunk_starts(idx: np.ndarray, size: int) -> np.ndarray:
    """Where :func:`swap_remove` cuts the picks ``idx`` from ``size`` rows into chunks.

    Returns:
        The sorted first picks of the chunks (``[0]`` if there is no conflict; empty if
        ``idx`` is).
    """
    n = len(idx)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    j = np.arange(n, dtype=np.int64)
    conflict = np.full(n, -1, dtype=np.int64)  # j -> latest earlier pick it conflicts with
    # sort (slot, pick) pairs as one uint64 (both < 2**32): ~2x faster than a stable argsort
    key = np.sort(idx.astype(np.uint64) << np.uint64(32) | j.astype(np.uint64))
    slot, order = (key >> np.uint64(32)).astype(np.int64), (key & 0xFFFFFFFF).astype(np.int64)
    same = np.flatnonzero(slot[1:] == slot[:-1])  # equal slots: earlier picks first
    conflict[order[same + 1]] = order[same]
    # idx[i] == t_j = size - 1 - j for a later j < n: only slots in the tail are at risk
    i = np.flatnonzero((idx >= size - n) & (idx < size - 1 - j))
    np.maximum.at(conflict, size - 1 - idx[i], i)
    cand = np.flatnonzero(conflict >= 0)
    conf = conflict[cand]
    starts = [0]
    c = k = 0
    while k < len(cand):  # next chunk: the first candidate that conflicts inside this one
        w = 64
        while True:  # widen the window geometrically: O(candidates) work in all
            hit = np.flatnonzero(conf[k : k + w] >= c)
            if len(hit) or k + w >= len(cand):
                break
            w *= 4
        if not len(hit):
            break
        k += int(hit[0])
        c = int(cand[k])
        starts.append(c)
        k += 1  # a chunk's first pick conflicts with nothing inside it
    return np.asarray(starts, dtype=np.int64)
