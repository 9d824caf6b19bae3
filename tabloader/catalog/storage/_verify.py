"""``tabloader verify``: read every stored byte of some datasets and report what is damaged.

Each part file is opened (size, batch count and identity checked) and each record batch read
once with a fresh reader (its values validated and its checksums compared), so nothing a
process has verified before is trusted. A damaged file or batch is reported as the ``_id``
range it holds, and the check goes on with the next batch or file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage._reader import DatasetReader


@dataclass(frozen=True)
class Damage:
    """Rows that cannot be read as imported.

    Attributes:
        dataset: the dataset.
        path: the data file.
        rows: the ``_id`` range (of the dataset's latest version).
        reason: the ``StorageError`` message.
    """

    dataset: str
    path: str
    rows: range
    reason: str

    def __str__(self) -> str:  # the reason names the file
        return f"{self.dataset}: rows {self.rows.start}..{self.rows.stop - 1}: {self.reason}"


@dataclass
class VerifyReport:
    """What ``Catalog.verify`` found.

    Attributes:
        datasets: the datasets checked.
        files: data files checked.
        batches: record batches read.
        rows: rows in those files.
        damaged: damaged row ranges, in order.
        unverified: files written before checksums (format 1): read and validated, but
            without checksums or identity to compare; re-import to add them.
    """

    datasets: list[str] = field(default_factory=list)
    files: int = 0
    batches: int = 0
    rows: int = 0
    damaged: list[Damage] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is damaged."""
        return not self.damaged

    @property
    def damaged_rows(self) -> int:
        """How many rows the damaged ranges hold."""
        return sum(len(d.rows) for d in self.damaged)

    def __str__(self) -> str:
        lines = [f"DAMAGED {d}" for d in self.damaged]
        lines += [
            f"UNVERIFIED {path}: written before checksums; re-import the dataset to add them"
            for path in self.unverified
        ]
        names = ", ".join(self.datasets) or "none"
        summary = (
            f"checked {len(self.datasets)} dataset(s) ({names}): {self.files} file(s), "
            f"{self.batches:,} record batches, {self.rows:,} rows"
        )
        if self.damaged:
            summary += (
                f"; {self.damaged_rows:,} rows damaged in {len(self.damaged)} range(s). "
                "Re-import the damaged datasets (DROP DATASET, then CREATE DATASET) or restore "
                "their files"
            )
        else:
            summary += "; no damage found"
        if self.unverified:
            summary += f"; {len(self.unverified)} file(s) unverified (no checksums)"
        return "\n".join([*lines, summary + "."])


def verify_readers(readers: Sequence[DatasetReader]) -> VerifyReport:
    """Check every file and record batch of ``readers`` (one per dataset); see the module."""
    report = VerifyReport()
    for shared in readers:
        # A fresh reader (nothing verified yet), reading with pread: a memory map would keep
        # every page it touched resident.
        reader = DatasetReader.from_spec(shared.spec(), memory_map=False)
        reader.verify = True
        report.datasets.append(reader.dataset)
        for index, part in enumerate(reader.parts):
            path = reader.locate_part(index)
            report.files += 1
            report.rows += part.num_rows
            try:
                checksummed = reader.checksummed(index)
            except StorageError as exc:
                report.damaged.append(
                    Damage(reader.dataset, path, range(part.first_id, part.end_id), str(exc))
                )
                continue
            if not checksummed:
                report.unverified.append(path)
            for batch in reader.ahead(index, range(part.num_batches)):  # (object storage)
                report.batches += 1
                try:
                    reader.record_batch(index, batch)
                except StorageError as exc:
                    rows = exc.rows or range(part.first_id, part.end_id)
                    report.damaged.append(Damage(reader.dataset, path, rows, str(exc)))
    return report
