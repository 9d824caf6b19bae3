"""Job weights: a job's ``weight`` expression evaluated to one float64 per row, and its file.

``REGISTER JOB j ... WITH (weight = '<expression>')`` checks the expression with the job predicate's
allow-list (``tabloader.catalog._sql.validate.check_predicate``), evaluates it in DuckDB over the
job's rows and refuses a NULL, NaN, infinite or negative weight, and weights that are all zero,
naming up to ``SHOWN_IDS`` rows: nothing is stored then. A NULL is refused rather than read as 0, so
a column with gaps does not silently drop rows from the job's draws; the error names ``COALESCE`` as
the fix.

The weights are derived data, kept as the bitmap is (``tabloader.catalog._job_bitmaps``): the
committed ``jobs`` row holds their CRC-32 (``weights_crc32``; NULL for a job without weights) and
the file ``jobs/<job>-<token>.weights`` (``directory.weights_path`` of the bitmap's file: float64
little-endian, aligned with the job's ids in ascending order) is written before the row commits. A
file lost or torn is evaluated again from the expression at the job's pinned dataset version (rows
appended later are not the job's, and stored rows never change) and checked against the CRC (the
expression and the predicate checked against the allow-list again first: the catalog's file may have
been edited by hand). A row with a ``weight`` and no CRC (or a CRC and no ``weight``) is damaged
(``Catalog.job`` says so, with the fix): never drawn uniformly in place of its weights. The sampler
scales the weights by their maximum before it sums them (``tabloader.sampling._weighted``), so
weights whose sum overflows float64 (600 rows of 1e306) are drawn as declared.
"""

from __future__ import annotations

import functools
import logging
import zlib

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import ID_COLUMN, bitmap_to_array
from tabloader.catalog._database import duckdb_errors, quote
from tabloader.catalog._directory import read_file, write_file
from tabloader.catalog._errors import OptionError, StatementError
from tabloader.catalog._job_bitmaps import PREDICATE, JobFiles
from tabloader.catalog._model import Dataset

logger = logging.getLogger(__name__)

SHOWN_IDS = 5
"""The most row ids an error about bad weights names."""

WEIGHT = "a job's weight"
"""What the allow-list's errors call a job's ``weight`` (``check_predicate``'s ``what``)."""

Weights = npt.NDArray[np.float64]


def weights_crc(weights: Weights) -> int:
    """The CRC-32 of ``weights`` as stored (float64 little-endian)."""
    return zlib.crc32(np.ascontiguousarray(weights, dtype="<f8").tobytes())


class JobWeights(JobFiles[Weights]):
    """Evaluate jobs' ``weight`` expressions and keep their weights files (:class:`JobFiles`)."""

    what = "weights"
    log = logger

    def evaluate(
        self, name: str, ds: Dataset, predicate: str | None, expression: str, ids: BitMap
    ) -> Weights:
        """The weight of each of the job's rows ``ids`` (those of ``ds`` that satisfy
        ``predicate``), in ascending id order. ``expression`` was checked
        (``check_predicate``).

        Raises:
            OptionError: DuckDB fails on it (a text that is no number, say), or a weight is
                NULL, NaN, infinite or negative, or all are zero; naming up to ``SHOWN_IDS``
                rows and the fix.
        """
        order = bitmap_to_array(ids).astype(np.int64)
        weights = np.zeros(order.size, dtype=np.float64)
        null = np.zeros(order.size, dtype=bool)
        seen = 0
        where = f"{ID_COLUMN} < {ds.num_rows}" + (f" AND ({predicate})" if predicate else "")
        sql = (
            f"SELECT {ID_COLUMN}, CAST(({expression}) AS DOUBLE) FROM {quote(ds.name)} "
            f"WHERE {where}"
        )
        with (
            duckdb_errors(
                f"The weight of job '{name}'",
                root=self.root,
                error=OptionError,
                fix="A weight is a number for each row: map text to numbers with CASE WHEN s = "
                "'a' THEN 1.0 ELSE 0.5 END.",
                limits=self.db.limits,
                arrow_stream=True,
            ),
            self.db.limits.timer(self.db.ids_con.interrupt),
        ):
            # rows come in any order (``ids_con``): each goes to its id's place in ``order``
            for batch in self.db.ids_con.sql(sql).to_arrow_reader(1 << 20):
                at = np.searchsorted(order, batch.column(0).to_numpy())
                values = batch.column(1)
                weights[at] = values.to_numpy(zero_copy_only=False)
                null[at] = values.is_null().to_numpy(zero_copy_only=False)
                seen += len(batch)
        if seen != order.size:  # pragma: no cover - the predicate selected these rows
            raise StatementError(f"Job '{name}': the weight covers {seen} of {order.size} rows.")
        _check(name, expression, order, weights, null)
        return weights

    def write(self, path: str, weights: Weights) -> None:
        """Write ``weights`` to ``path`` (relative to the catalog directory)."""
        write_file(self.root / path, np.ascontiguousarray(weights, dtype="<f8").tobytes())

    def read(
        self,
        name: str,
        ds: Dataset,
        predicate: str | None,
        expression: str,
        ids: BitMap,
        path: str,
        crc: int,
    ) -> Weights:
        """Read a job's weights and check them against its row (``len(ids)``, CRC-32 ``crc``).

        A file that is missing, torn, not a regular file or not the job's is evaluated again
        from ``expression`` at the job's pinned version ``ds`` when that gives the stored
        weights back (and written again). The stored ``expression`` and ``predicate`` are
        checked against the allow-list again first: a hand-edited catalog runs no other SQL.

        Raises:
            StorageError: the file is bad and the expression does not give the weights back;
                the message says which, and how to re-register the job.
        """
        file = self.root / path

        def load() -> Weights | str:
            blob = read_file(file, what=f"its file {file}", size=8 * len(ids))
            if zlib.crc32(blob) == crc:
                return np.frombuffer(blob, dtype="<f8").astype(np.float64)
            return "does not hold the job's weights (its CRC-32 differs from the stored one)"

        def rebuild() -> Weights | str:
            where = None if predicate is None else self.checked(predicate, ds, PREDICATE)
            weight = self.checked(expression, ds, WEIGHT)
            weights = self.evaluate(name, ds, where, weight, ids)
            if weights_crc(weights) == crc:
                return weights
            return f"its weight gives other values at '{ds.name}' version {ds.version}"

        fails = f"its weight fails at version {ds.version}"
        save = functools.partial(self.write, path)
        return self._read_or_rebuild(name, file, load, rebuild, fails, save)


def _check(name: str, expression: str, ids: np.ndarray, w: Weights, null: np.ndarray) -> None:
    """Refuse NULL, non-finite or negative weights, or weights that are all zero."""
    shown = expression if len(expression) <= 60 else expression[:57] + "..."
    subject = f"Job '{name}': weight {shown}"
    bad_finite = ~null & ~np.isfinite(w)
    for mask, what, fix in (
        (
            null,
            "is NULL",
            f"a weight must be a number: write COALESCE({shown}, 0) to give those rows "
            "weight 0, or leave them out with WHERE",
        ),
        (
            bad_finite,
            "is NaN or infinite",
            "a weight must be finite: map those values to a number with CASE WHEN isnan(x) OR "
            "isinf(x) THEN 0 ELSE x END, or leave the rows out with WHERE",
        ),
        (
            ~null & ~bad_finite & (w < 0),
            "is negative",
            f"a weight must be >= 0: write greatest({shown}, 0), or leave the rows out with WHERE",
        ),
    ):
        if mask.any():
            rows = np.flatnonzero(mask)
            named = ", ".join(
                f"{ids[i]} ({'NULL' if null[i] else repr(float(w[i]))})" for i in rows[:SHOWN_IDS]
            )
            more = f" and {rows.size - SHOWN_IDS} more" if rows.size > SHOWN_IDS else ""
            raise OptionError(
                f"{subject} {what} for {rows.size} of its {ids.size} rows (_id {named}{more}); "
                f"{fix}."
            )
    if not w.any():
        named = ", ".join(str(i) for i in ids[:SHOWN_IDS])
        raise OptionError(
            f"{subject} is 0 for all {ids.size} rows (_id {named}"
            f"{', ...' if ids.size > SHOWN_IDS else ''}), so no row could be drawn; give some "
            "rows a positive weight."
        )
