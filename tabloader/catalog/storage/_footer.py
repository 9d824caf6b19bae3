"""Where an Arrow IPC file's record batches lie, read from its footer alone.

A store whose reads are requests (object storage) fetches a record batch in one ranged read
of its bytes, the message's metadata and body together, so it must know where each batch
lies before Arrow's file reader asks: pyarrow does not expose the footer's blocks, so they
are read here from the footer's flatbuffer (``File.fbs``: ``Footer { version, schema,
dictionaries: [Block], recordBatches: [Block] }``, ``Block { offset: long, metaDataLength:
int, bodyLength: long }``, 24 bytes each). Only those two vectors are read; anything else
in the footer is Arrow's to decode.

The file ends with ``<footer><int32 footer length>ARROW1``.
"""

from __future__ import annotations

import struct

import numpy as np
import numpy.typing as npt

MAGIC = b"ARROW1"
TAIL_BYTES = 10  # the footer's length and the magic at the file's end
_BLOCK = np.dtype([("offset", "<i8"), ("meta", "<i4"), ("pad", "<i4"), ("body", "<i8")])


class Footer:
    """The blocks of one file.

    Attributes:
        start: the footer's first byte in the file.
        batches: one row per record batch: ``offset``, ``meta`` (metadata length, padding
            included) and ``body`` (body length); a batch's bytes are
            ``[offset, offset + meta + body)``.
        dictionaries: the same for the dictionary batches.
    """

    def __init__(
        self, start: int, batches: npt.NDArray[np.void], dictionaries: npt.NDArray[np.void]
    ) -> None:
        self.start, self.batches, self.dictionaries = start, batches, dictionaries

    def batch_range(self, index: int) -> tuple[int, int]:
        """(offset, length) of record batch ``index``'s bytes."""
        b = self.batches[index]
        return int(b["offset"]), int(b["meta"]) + int(b["body"])


def footer_length(tail: bytes, size: int) -> int:
    """The footer's length, from the file's last ``TAIL_BYTES`` bytes (of a file of ``size``).

    Raises:
        ValueError: not the end of an Arrow IPC file, or a length that does not fit in it.
    """
    if len(tail) < TAIL_BYTES or tail[-6:] != MAGIC:
        raise ValueError("not an Arrow IPC file (no ARROW1 at its end)")
    (length,) = struct.unpack("<i", tail[-TAIL_BYTES:-6])
    if not 0 < length <= size - TAIL_BYTES - 8:
        raise ValueError(f"a footer of {length} bytes does not fit a file of {size} bytes")
    return int(length)


def parse_footer(footer: bytes, start: int, size: int) -> Footer:
    """The blocks of the footer ``footer`` (its flatbuffer, without the length and magic),
    which starts at byte ``start`` of a file of ``size`` bytes.

    Raises:
        ValueError: the flatbuffer is malformed, or a block lies outside the file's data.
    """
    try:
        (table,) = struct.unpack_from("<I", footer, 0)
        (back,) = struct.unpack_from("<i", footer, table)
        vtable = table - back
        vt_size, _ = struct.unpack_from("<HH", footer, vtable)

        def vector(field: int) -> npt.NDArray[np.void]:
            at = vtable + 4 + 2 * field
            if at + 2 > vtable + vt_size:
                return np.empty(0, _BLOCK)
            (off,) = struct.unpack_from("<H", footer, at)
            if off == 0:
                return np.empty(0, _BLOCK)
            pos = table + off
            (rel,) = struct.unpack_from("<I", footer, pos)
            (n,) = struct.unpack_from("<I", footer, pos + rel)
            return np.frombuffer(footer, _BLOCK, count=n, offset=pos + rel + 4).copy()

        dictionaries, batches = vector(2), vector(3)
    except (struct.error, ValueError) as exc:
        raise ValueError(f"malformed footer ({exc})") from None
    for blocks in (dictionaries, batches):
        if blocks.size:
            ends = blocks["offset"] + blocks["meta"] + blocks["body"]
            if (blocks["offset"] < 8).any() or (ends > start).any() or (blocks["meta"] < 0).any():
                raise ValueError("a block of the footer lies outside the file's data")
    return Footer(start, batches, dictionaries)
