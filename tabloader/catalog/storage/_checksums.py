"""Checksums of stored record batches, and the identity every data file carries.

**Identity.** A part file's schema metadata names the dataset, the part (the dataset version
that added it), the file's own name (with its random token) and its first ``_id``. The reader
compares them with the catalog's row for the part when it opens the file, so a file swapped
for another dataset's file, or for the other part of the same dataset, is refused even at
equal size (the size check alone let such files through).

**Checksums.** Each record batch carries, in its own custom metadata, one 64-bit xxHash3 per
top-level column (``KEY_DIGESTS``): one per column so a reader that reads some columns
(``IpcReadOptions.included_fields``, as the loading engine does) verifies exactly the bytes it
read. A digest covers the column's buffers *as a reader decodes them* (sizes and bytes, every
child's), computed at import from the batch serialized the way the writer serializes it, so
reading never needs the raw file layout. Padding between buffers is not covered (no reader
looks at it). Why xxHash3 and not CRC32C: on ~100 KB buffers ``xxhash.xxh3_64_intdigest``
ran at ~50 GB/s, ``crc32c`` at ~18 GB/s and ``google-crc32c`` at ~13 GB/s (one core, warm
cache); the verify-once cost is what a random single-row read pays.

**Older files.** Files written before this format have no ``tabloader.format`` key: they open
as before, unverified (no identity or checksum check), and ``tabloader verify`` lists them.
Re-importing the dataset writes them anew with checksums.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import pyarrow as pa
import xxhash

FORMAT = "2"  # files without KEY_FORMAT are format 1: no identity, no checksums
ALGORITHM = "xxh3_64"
KEY_FORMAT = b"tabloader.format"
KEY_DATASET = b"tabloader.dataset"
KEY_PART = b"tabloader.part"
KEY_FILE = b"tabloader.file"
KEY_FIRST_ID = b"tabloader.first_id"
KEY_ALGORITHM = b"tabloader.checksum"
KEY_DIGESTS = b"tabloader.xxh3_64"  # per record batch: one hex digest per column, comma-separated


@dataclass(frozen=True)
class FileIdentity:
    """Whose rows a part file holds.

    Attributes:
        dataset: the dataset's name (also its folder, ``data/<dataset>/``).
        part: the dataset version that added the part (one part per import or append).
        file: the part file's name, ``part-v<version>-<token>.arrow``; the token is random, so
            it tells apart two datasets of the same name in different catalogs, or a dataset
            dropped and created again.
        first_id: the ``_id`` of the part's first row.
    """

    dataset: str
    part: int
    file: str
    first_id: int

    @classmethod
    def of_part(cls, path: str, version: int, first_id: int) -> FileIdentity:
        """The identity the catalog expects of the part at ``path`` (``data/<dataset>/<file>``)."""
        p = PurePosixPath(path)
        return cls(p.parent.name, version, p.name, first_id)

    def metadata(self) -> dict[bytes, bytes]:
        """The schema metadata that records this identity (and the checksum format)."""
        return {
            KEY_FORMAT: FORMAT.encode(),
            KEY_DATASET: self.dataset.encode(),
            KEY_PART: str(self.part).encode(),
            KEY_FILE: self.file.encode(),
            KEY_FIRST_ID: str(self.first_id).encode(),
            KEY_ALGORITHM: ALGORITHM.encode(),
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[bytes, bytes] | None) -> FileIdentity | None:
        """The identity a file's schema metadata records; None for a file of format 1.

        Raises:
            ValueError: the metadata is of an unknown format or incomplete.
        """
        if not metadata or KEY_FORMAT not in metadata:
            return None
        if metadata[KEY_FORMAT] != FORMAT.encode():
            raise ValueError(f"unknown tabloader file format {metadata[KEY_FORMAT]!r}")
        if metadata.get(KEY_ALGORITHM) != ALGORITHM.encode():
            raise ValueError(f"unknown checksum {metadata.get(KEY_ALGORITHM)!r}")
        try:
            return cls(
                metadata[KEY_DATASET].decode(),
                int(metadata[KEY_PART]),
                metadata[KEY_FILE].decode(),
                int(metadata[KEY_FIRST_ID]),
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"incomplete file identity ({exc!r})") from None

    def describe(self) -> str:
        return f"dataset '{self.dataset}' part {self.part} (file {self.file}, first id " + (
            f"{self.first_id})"
        )


def column_digest(array: pa.Array) -> int:
    """xxHash3 (64 bits) of ``array``'s buffers, children's included, sizes included.

    The buffers are those of an array as the IPC reader decodes it (offset 0, a missing
    validity bitmap as None), so the writer hashes a decoded copy (``batch_digests``).
    """
    h = 0
    for buf in array.buffers():
        if buf is None:
            h = xxhash.xxh3_64_intdigest(b"-", seed=h)
        else:
            h = xxhash.xxh3_64_intdigest(buf, seed=h ^ buf.size)
    if pa.types.is_dictionary(array.type):
        h = xxhash.xxh3_64_intdigest(b"d", seed=h ^ column_digest(array.dictionary))
    return h


def _decoded(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` serialized and decoded again, as a reader of the file will see it."""
    if any(_has_dictionary(f.type) for f in batch.schema):  # a stream carries dictionaries
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as w:
            w.write_batch(batch)
        return pa.ipc.open_stream(sink.getvalue()).read_next_batch()
    return pa.ipc.read_record_batch(batch.serialize(), batch.schema)


def _has_dictionary(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        return True
    return any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


def batch_digests(batch: pa.RecordBatch) -> list[int]:
    """One digest per column of ``batch`` as it will read back from an IPC file."""
    decoded = _decoded(batch)
    return [column_digest(c) for c in decoded.columns]


def digests_metadata(batch: pa.RecordBatch) -> dict[bytes, bytes]:
    """The custom metadata the writer stores with ``batch``: its columns' digests."""
    return {KEY_DIGESTS: ",".join(f"{d:016x}" for d in batch_digests(batch)).encode()}


def parse_digests(metadata: Any, num_columns: int) -> list[int]:
    """The digests a record batch's custom metadata records.

    Raises:
        ValueError: missing or malformed.
    """
    if metadata is None or KEY_DIGESTS not in metadata:
        raise ValueError("the record batch has no checksum")
    values = metadata[KEY_DIGESTS].split(b",")
    if len(values) != num_columns:
        raise ValueError(f"the record batch has {len(values)} checksums for {num_columns} columns")
    return [int(v, 16) for v in values]
