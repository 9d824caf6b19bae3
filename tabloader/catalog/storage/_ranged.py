"""Part files of a store whose reads are requests (object storage): ranged reads of what is
needed, a record batch per range.

Arrow's IPC file reader reads a record batch in two or more reads (its metadata, then its
body, or the body's buffers of the columns asked for); on a local file each is a ``pread``,
on object storage each would be a request (~10 ms). So a :class:`PartFile` knows where every
record batch lies (from the footer, :mod:`tabloader.catalog.storage._footer`, fetched once with the
file's tail) and fetches a batch's bytes, metadata and body, in one ranged read before Arrow
asks (``load``); Arrow's reads of them are then served from memory. Adjacent batches are
fetched in one request (up to ``MAX_REQUEST_BYTES``) and the requests of one ``load`` are in
flight together (the store's ``read_ranges``). A read of bytes not loaded (the footer aside)
fetches exactly those bytes.

Memory: a loaded batch is held until ``release`` (counted, so two readers of one batch share
one copy); a caller loads what it was asked to read, in windows of at most
``WINDOW_BYTES`` (``windows``), and releases each window when done with it. Nothing else is
kept but the file's tail.

The file is handed to Arrow as ``pa.PythonFile`` over a view with its own position
(``file``), one per opened reader; Arrow serializes the reads of one such file under its
lock, which costs nothing here: they are copies out of memory, the requests happen in
``load``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage._footer import TAIL_BYTES, Footer, footer_length, parse_footer
from tabloader.catalog.storage._tier import TAIL

if TYPE_CHECKING:
    from tabloader.catalog.storage._tier import BatchCache

TAIL_FETCH_BYTES = 64 << 10  # the first request of a part: its last bytes (footer and all)
MAX_REQUEST_BYTES = 8 << 20  # adjacent batches are fetched in one request up to this size
WINDOW_BYTES = 64 << 20  # a caller holds at most this much of one read's batches at once

ReadRanges = Callable[[Sequence[tuple[int, int]]], list[Any]]
"""``read_ranges([(offset, length), ...]) -> [bytes-like, ...]``: each range of one object
in one request, all in flight together; retried; raises ``StorageError`` when it cannot."""


def coalesce(ranges: Sequence[tuple[int, int]], limit: int) -> list[tuple[int, int, list[int]]]:
    """``ranges`` (offset, length), sorted by offset, merged where one ends where the next
    begins, up to ``limit`` bytes a merge: ``(offset, length, indices of the ranges in it)``."""
    out: list[tuple[int, int, list[int]]] = []
    for i, (offset, length) in enumerate(ranges):
        if out:
            start, n, members = out[-1]
            if start + n == offset and n + length <= limit:
                out[-1] = (start, n + length, [*members, i])
                continue
        out.append((offset, length, [i]))
    return out


class _Held:
    __slots__ = ("count", "data")

    def __init__(self, data: Any) -> None:
        self.data, self.count = data, 1


class PartFile:
    """One part file, read by ranges through ``read_ranges`` (see the module docstring).

    Args:
        read_ranges: the object's ranges, fetched (``ReadRanges``).
        size: the file's size as the catalog recorded it.
        what: the file, for messages ("Data file 's3://…' of dataset 'd'").
        name: the part's name under its store's root (a cache's key).
        uri: its store's URI.
        cache: where batches (and the tail) are looked for before they are fetched, and
            offered once read (:class:`~tabloader.catalog.storage._tier.BatchCache`: the
            storage tier); None: none.

    Raises:
        StorageError: the file's tail is not an Arrow IPC file's (or its footer is damaged).
    """

    def __init__(
        self,
        read_ranges: ReadRanges,
        size: int,
        what: str,
        *,
        name: str = "",
        uri: str = "",
        cache: BatchCache | None = None,
    ) -> None:
        self.read_ranges, self.size, self.what = read_ranges, size, what
        self.name, self.uri = name, uri
        n = min(size, TAIL_FETCH_BYTES)
        cached = cache.get(self, TAIL) if cache is not None and name else None
        self._tail_caches: list[BatchCache] = []  # the caches offered the tail
        if cache is not None and cached is not None and len(cached) == n:
            tail = cached
            self._tail_caches.append(cache)
        else:
            tail = memoryview(read_ranges([(size - n, n)])[0])
        try:
            length = footer_length(bytes(tail[-TAIL_BYTES:]), size)
            start = size - TAIL_BYTES - length
            if start < size - n:  # a footer longer than the tail fetched: fetch it whole
                tail = memoryview(read_ranges([(start, length + TAIL_BYTES)])[0])
                n = length + TAIL_BYTES
            at = start - (size - n)
            self.footer: Footer = parse_footer(bytes(tail[at : at + length]), start, size)
        except ValueError as exc:
            if cached is not None and cache is not None:
                cache.drop(self, TAIL)
            raise StorageError(f"{what} is not a readable Arrow IPC file: {exc}.") from None
        # kept while the file is open: its tail, and its dictionaries (read at every open)
        self._pinned: list[tuple[int, memoryview]] = [(size - n, tail)]
        self.keep_tail(cache)
        blocks = self.footer.dictionaries
        if blocks.size:
            ranges = [(int(b["offset"]), int(b["meta"] + b["body"])) for b in blocks]
            merged = coalesce(sorted(ranges), MAX_REQUEST_BYTES)
            got = read_ranges([(offset, length) for offset, length, _ in merged])
            self._pinned += [(m[0], memoryview(d)) for m, d in zip(merged, got, strict=True)]
        self._held: dict[int, _Held] = {}  # record batch -> its bytes, while loaded
        # record batch -> (its fetch, the loads waiting for it): one fetch per batch at a time
        self.inflight: dict[int, list[Any]] = {}
        self._starts = np.ascontiguousarray(self.footer.batches["offset"])
        self._lock = threading.Lock()

    def keep_tail(self, cache: BatchCache | None) -> None:
        """Offer the tail to ``cache`` if it was not yet: a part opened first without one
        (by the catalog's own reads) still leaves its tail in the storage tier for the
        next process."""
        if cache is None or not self.name or any(c is cache for c in self._tail_caches):
            return
        self._tail_caches.append(cache)
        cache.offer(self, TAIL, self.tail())

    def tail(self) -> memoryview:
        """The file's last ``TAIL_FETCH_BYTES`` (its tail as a cache keeps it)."""
        data = self._pinned[0][1]
        return data[len(data) - min(self.size, TAIL_FETCH_BYTES) :]

    @property
    def num_batches(self) -> int:
        return len(self.footer.batches)

    def batch_bytes(self, batch: int) -> int:
        """The size of record batch ``batch``'s bytes (metadata and body)."""
        return self.footer.batch_range(batch)[1]

    def windows(self, batches: Iterable[int]) -> Iterator[list[int]]:
        """``batches`` in consecutive runs of at most ``WINDOW_BYTES`` (one batch at least)."""
        window: list[int] = []
        nbytes = 0
        for b in batches:
            n = self.batch_bytes(b)
            if window and nbytes + n > WINDOW_BYTES:
                yield window
                window, nbytes = [], 0
            window.append(b)
            nbytes += n
        if window:
            yield window

    def load(self, batches: Iterable[int], cache: BatchCache | None = None) -> None:
        """Hold the record batches ``batches`` until ``release``: each loaded already gets one
        hold more; one being fetched by another load is waited for (and fetched by this one if
        that fetch fails: its error is not this load's); the others are looked for in
        ``cache``, then fetched (adjacent ones in one request, the requests in flight
        together).

        Raises:
            StorageError: a batch could not be fetched (the batches this load holds are
                released).
        """
        mine: list[int] = []
        waits: list[tuple[int, Future[None]]] = []
        done: list[int] = []  # holds taken, to give back if the load fails
        with self._lock:
            for b in sorted(set(batches)):
                held = self._held.get(b)
                if held is not None:
                    held.count += 1
                    done.append(b)
                elif b in self.inflight:
                    flight = self.inflight[b]
                    flight[1] += 1  # its hold is added when it lands
                    waits.append((b, flight[0]))
                else:
                    self.inflight[b] = [Future(), 0]
                    mine.append(b)
        error: BaseException | None = None
        if mine:
            try:
                self._land(mine, cache)
                done += mine
            except BaseException as exc:
                error = exc
        for b, future in waits:  # each, so that every hold taken is known
            try:
                future.result()
            except Exception:  # the load waited for failed (the read-ahead's, its tries
                try:  # spent while this one waited): one fetch of this load's own
                    self.load([b], cache)
                except BaseException as exc:
                    error = error or exc
                    continue
            except BaseException as exc:
                error = error or exc
                continue
            done.append(b)
        if error is not None:
            self.release(done)
            raise error

    def _land(self, batches: list[int], cache: BatchCache | None) -> None:
        """Fetch ``batches`` (each in flight under this load) and hold them."""
        try:
            fetched = self._fetch(batches, cache)
        except BaseException as exc:
            with self._lock:
                flights = [self.inflight.pop(b) for b in batches]
            for flight in flights:
                flight[0].set_exception(exc)
            raise
        with self._lock:
            flights = []
            for b, data in zip(batches, fetched, strict=True):
                flight = self.inflight.pop(b)
                held = self._held.get(b)
                if held is None:
                    held = self._held[b] = _Held(data)
                    held.count = 1 + flight[1]
                else:  # (not loaded twice at once: only by refetch meanwhile)
                    held.count += 1 + flight[1]
                flights.append(flight)
        for flight in flights:
            flight[0].set_result(None)

    def held(self, batch: int) -> bool:
        """Whether record batch ``batch`` is loaded (held in memory) now."""
        return batch in self._held

    def loading(self, batch: int) -> bool:
        """Whether record batch ``batch`` is loaded or being fetched now."""
        return batch in self._held or batch in self.inflight

    def held_bytes(self) -> int:
        """The bytes of the record batches held now."""
        with self._lock:
            return sum(len(h.data) for h in self._held.values())

    def refetch(self, batch: int, cache: BatchCache | None = None) -> None:
        """Fetch loaded record batch ``batch`` again, from the store (its bytes failed their
        check; ``cache``, which may have served them, forgets them)."""
        if cache is not None:
            cache.drop(self, batch)
        (data,) = self._fetch([batch], None)
        with self._lock:
            held = self._held.get(batch)
            if held is not None:
                held.data = data

    def release(self, batches: Iterable[int], cache: BatchCache | None = None) -> None:
        """One hold less on each of ``batches``; a batch no one holds is dropped, and offered
        to ``cache`` (its readers are done with it: a cache ranks it by its next use)."""
        gone: list[tuple[int, _Held]] = []
        with self._lock:
            for b in set(batches):
                held = self._held.get(b)
                if held is not None and held.count > 0:
                    held.count -= 1
                    if held.count == 0:
                        gone.append((b, held))
                        if cache is None:
                            del self._held[b]
        if cache is None or not gone:
            return
        for b, held in gone:  # held (at no count) while offered: a load meanwhile takes it
            cache.offer(self, b, held.data)
        with self._lock:
            for b, held in gone:
                if held.count == 0 and self._held.get(b) is held:
                    del self._held[b]

    def _fetch(self, batches: list[int], cache: BatchCache | None) -> list[memoryview]:
        """The bytes of ``batches`` (sorted): from ``cache`` where it has them, the others
        fetched, adjacent ones in one request."""
        out: list[memoryview] = [memoryview(b"")] * len(batches)
        todo = []
        for i, b in enumerate(batches):
            data = self._in_tail(b)
            if data is None and cache is not None:
                data = cache.get(self, b)
                if data is not None and len(data) != self.batch_bytes(b):
                    data = None
            if data is None:
                todo.append(i)
            else:
                out[i] = data
        if not todo:
            return out
        ranges = [self.footer.batch_range(batches[i]) for i in todo]
        merged = coalesce(ranges, MAX_REQUEST_BYTES)
        got = self.read_ranges([(offset, length) for offset, length, _ in merged])
        for (offset, _, members), data in zip(merged, got, strict=True):
            view = memoryview(data)
            for m in members:
                at = ranges[m][0] - offset
                out[todo[m]] = view[at : at + ranges[m][1]]
        return out

    def _in_tail(self, batch: int) -> memoryview | None:
        """Batch ``batch``'s bytes if the tail fetched at open holds them (the last batches
        of a part whose footer is small), else None."""
        start, length = self.footer.batch_range(batch)
        for at, data in self._pinned:
            if at <= start and start + length <= at + len(data):
                return data[start - at : start - at + length]
        return None

    def read(self, offset: int, n: int) -> Any:
        """``n`` bytes at ``offset``: from a loaded batch or the tail where they lie in one,
        else fetched (exactly those bytes)."""
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        for start, data in self._pinned:
            if start <= offset and offset + n <= start + len(data):
                return data[offset - start : offset - start + n]
        b = int(np.searchsorted(self._starts, offset, side="right")) - 1  # the batch there
        with self._lock:
            held = self._held.get(b) if b >= 0 else None
            if held is not None:
                start = int(self._starts[b])
                if offset + n <= start + len(held.data):
                    return held.data[offset - start : offset - start + n]
        return self.read_ranges([(offset, n)])[0]

    def file(self) -> pa.NativeFile:
        """A new random-access file over this part, for Arrow (its own position)."""
        return pa.PythonFile(_View(self), mode="r")


class _View:
    """A file object over a :class:`PartFile` (or an ``ObjectFile``) with its own position
    (``pa.PythonFile``)."""

    def __init__(self, part: PartFile | ObjectFile) -> None:
        self.part, self.pos, self.closed = part, 0, False

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.part.size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> Any:
        if n is None or n < 0:
            n = self.part.size - self.pos
        data = self.part.read(self.pos, n)
        self.pos += len(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


READAHEAD_BYTES = 4 << 20  # an ObjectFile's reads of fewer bytes fetch this much at once


class ObjectFile:
    """A whole object read through ranged reads, for readers of sources (Parquet, Arrow IPC)
    that make many small reads: each read that misses the last fetched range fetches at
    least ``READAHEAD_BYTES`` from where it starts (one range kept: bounded memory).

    Args:
        read_range: ``(offset, length) -> bytes-like`` of the object.
        size: the object's size.
    """

    def __init__(self, read_range: Callable[[int, int], Any], size: int) -> None:
        self.read_range, self.size = read_range, size
        self._start, self._data = 0, memoryview(b"")
        self._lock = threading.Lock()

    def read(self, offset: int, n: int) -> Any:
        n = max(0, min(n, self.size - offset))
        if n == 0:
            return b""
        with self._lock:
            start, data = self._start, self._data
            if not (start <= offset and offset + n <= start + len(data)):
                length = min(self.size - offset, max(n, READAHEAD_BYTES))
                start, data = offset, memoryview(self.read_range(offset, length))
                self._start, self._data = start, data
            return data[offset - start : offset - start + n]

    def file(self) -> pa.NativeFile:
        """A random-access file over the object, for Arrow."""
        return pa.PythonFile(_View(self), mode="r")
