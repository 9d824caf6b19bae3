"""Per-row importance from a job's own losses, as SHADE (FAST'23) scores it.

SHADE (``R-I-S-Khan/SHADE``, ``shade_utils/shadesampler.py``, class ``ShadeSampler``) keeps
one weight per sample and draws each epoch from them:

* **Rank-based score** (``ShadeSampler.__init__`` builds ``batch_wts[j] = log(j + 10)``;
  ``set_importance_per_batch`` argsorts the minibatch's per-sample losses and gives the
  sample of rank ``j`` the weight ``batch_wts[j]``). Scores depend only on a row's rank
  inside its own minibatch, so scores from different batches and epochs compare even as
  the loss falls. We follow it: within one reported batch a row's score is
  ``log(k + B0)`` with ``k`` the number of rows of that batch with a strictly lower loss
  and ``B0 = 10`` (their ``+ 10``). A newer report of a row replaces its score, as SHADE's
  assignment ``self.weights[idx] = batch_wts`` does.
* **Ties.** SHADE's ``torch.argsort`` breaks ties in an unspecified order, so two rows with
  the same loss get different scores depending on their position in the batch. We count
  *strictly* lower losses, so tied rows share the lower score (``[1, 1, 2]`` ranks as
  ``k = [0, 0, 2]``): the score does not depend on the order of the batch. A row that
  appears twice in one batch (epochs drawn with replacement repeat rows) counts twice in
  the ranking and keeps the higher of its scores.
* **Prior for unseen rows** (``self.weights = torch.ones(n) * init_fac``, ``init_fac = 1``):
  a row never reported has score ``PRIOR = 1.0``. Note that this is below the lowest
  reported score ``log(10) ~ 2.30``: SHADE draws unseen rows less often than seen ones
  until they are reported. We keep their value.
* **PADS probabilities** (``ShadeSampler.__iter__``: ``torch.multinomial(self.weights.add(
  self.ls_param), n, replacement)``): probabilities are proportional to the scores plus a
  flattening term added to every row. SHADE's ``ls_param`` is 1% of the previous epoch's
  mean training loss, rescaled each epoch by ``exp(relative loss change)``
  (``on_epoch_end``), so its size is in units of the loss and fades as training converges.
  We keep the additive form but size the term in units of the scores and keep it fixed:
  ``c = FLATTEN * mean(scores)``, so ``p_i = (s_i + c) / sum(s + c)`` which is the mixture
  ``p_i = (1 - lam) * s_i / sum(s) + lam / N`` with ``lam = FLATTEN / (1 + FLATTEN)``. It
  needs no epoch-end callback and never vanishes.
* **Floor.** Every score lies in ``[PRIOR, S_MAX]`` with ``S_MAX = log(ROWS_MAX - 1 + B0)``
  (the highest rank in the largest batch :meth:`ImportanceScores.report` accepts), so
  ``mean(s) <= S_MAX`` and every row has ``p_i >= floor(N) = (PRIOR / S_MAX + FLATTEN) /
  ((1 + FLATTEN) * N)``, about ``0.17 / N``. The importance weight ``1 / (N * p_i)`` a
  batch carries is therefore at most ``1 / (N * floor(N))``, about 5.8.

What SHADE also does and this module leaves to others: the epoch's draws and their order
(the sampler), the cache policy on the scores (:mod:`tabloader.engine._arena.eviction`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_to_array, serialized_max
from tabloader.catalog._errors import LoaderError, SamplingError, TabloaderError

REPORT_ROWS_MAX = 65_536
"""The most rows one report may carry: a minibatch's, never an epoch's (bounds the message)."""


def report_arrays(
    ids: Any, losses: Any, error: type[TabloaderError] = LoaderError
) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` (a batch's ``_id``) and their per-row ``losses`` as int64 and float64 arrays,
    checked: 1-D, equally long, at most ``REPORT_ROWS_MAX`` rows, integer ids, finite real
    losses (``ImportanceScores.report`` checks them so too, raising ``SamplingError``).

    Raises:
        error: one of those does not hold (the message names the fix).
    """
    ids, losses = np.asarray(ids), np.asarray(losses)
    if ids.ndim != 1 or losses.ndim != 1:
        raise error(
            f"report takes 1-D ids and losses (1-D arrays, one loss per row); got shapes "
            f"{ids.shape} and {losses.shape}: compute the loss per row (reduction='none') and "
            "flatten it."
        )
    if ids.size != losses.size:
        raise error(
            f"report got {ids.size} ids and {losses.size} losses; pass batch['_id'] and one "
            "loss per row of that batch."
        )
    if ids.size > REPORT_ROWS_MAX:
        raise error(
            f"report got {ids.size} rows, more than {REPORT_ROWS_MAX}; report each batch on "
            "its own."
        )
    if ids.size and ids.dtype.kind not in "iu":
        raise error(
            f"report ids must be integers: pass integer ids (batch['_id']), got dtype {ids.dtype}."
        )
    if ids.size and losses.dtype.kind not in "iuf":
        raise error(
            f"report losses must be real numbers, got dtype {losses.dtype}; pass the per-row "
            "loss as floats."
        )
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise error(
            f"report names rows above {np.iinfo(np.int64).max}, which no job has; pass "
            "batch['_id'] of this job's own batches."
        )
    ids, losses = ids.astype(np.int64), losses.astype(np.float64)
    finite = np.isfinite(losses)
    if not bool(finite.all()):
        raise error(
            f"report got non-finite losses (NaN or inf) for rows {ids[~finite][:3].tolist()}; "
            "report finite per-row losses (a diverged step: skip its report)."
        )
    return ids, losses


B0 = 10.0
"""SHADE's offset in ``log(rank + B0)``: the lowest-loss row of a batch scores ``log(10)``."""

PRIOR = 1.0
"""The score of a row no report has named yet (SHADE's ``init_fac``)."""

FLATTEN = 0.1
"""The flattening term added to every score, as a share of the mean score."""

ROWS_MAX = REPORT_ROWS_MAX
"""The most rows one :meth:`ImportanceScores.report` accepts (a minibatch, not an epoch): the
report path's bound (``JobDataset.report``, the service's message)."""

S_MAX = math.log(ROWS_MAX - 1 + B0)
"""The highest score a report can give: the top rank of the largest batch."""

_STATE_VERSION = 1


def _bounded(data: Any, rows: int | None) -> bytes:
    """A state's serialized ids, at most the bytes of a bitmap of ``rows`` ids."""
    if rows is not None and len(data) > serialized_max(rows):
        raise ValueError(f"its ids take {len(data)} bytes, more than {rows} rows do")
    return bytes(data)


def floor(n: int) -> float:
    """The least probability any row of an ``n``-row job gets from :meth:`probabilities`."""
    return (PRIOR / S_MAX + FLATTEN) / ((1.0 + FLATTEN) * n)


class ImportanceScores:
    """SHADE's rank-based scores of one job's rows, and the distribution drawn from them.

    ``ids``: the job's row ids, sorted ascending and unique (int64); scores and
    probabilities are aligned with them.

    Example:
        >>> s = ImportanceScores(np.arange(4, dtype=np.int64))
        >>> s.report(np.array([2, 0]), np.array([0.5, 0.1]))
        >>> [round(float(v), 3) for v in s.scores]
        [2.303, 1.0, 2.398, 1.0]
    """

    def __init__(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise SamplingError(
                "ImportanceScores needs the job's row ids as a non-empty 1-D integer array; "
                f"got shape {ids.shape}, dtype {ids.dtype}."
            )
        ids = ids.astype(np.int64, copy=True)
        if not (ids[0] >= 0 and ids[-1] < 1 << 32 and bool(np.all(ids[1:] > ids[:-1]))):
            raise SamplingError(
                "ImportanceScores needs sorted unique row ids in [0, 2**32); pass "
                "bitmap_to_array(job ids)."
            )
        self.ids = ids
        self.scores = np.full(ids.size, PRIOR, dtype=np.float64)
        # each row's rank + 1 in the batch that scored it last (0: never reported): the state
        # keeps these, 4 bytes a row before compression, not the scores' 8
        self.ranks = np.zeros(ids.size, dtype=np.int32)

    def __len__(self) -> int:
        return int(self.ids.size)

    def report(self, ids: np.ndarray, losses: np.ndarray) -> None:
        """Score one reported minibatch: row ``ids[i]`` had per-row loss ``losses[i]``.

        Raises:
            SamplingError: the arrays are not 1-D, differ in length, hold more than
                ``ROWS_MAX`` rows, ids are not integers or not rows of the job, or a loss is
                not a finite real number. Nothing is scored when it raises.
        """
        pos, loss = self._check(ids, losses)
        if loss.size == 0:
            return
        lower = np.searchsorted(np.sort(loss), loss, side="left")  # rows with a lower loss
        score = np.log(lower + B0)
        # A row listed twice keeps its higher score: order by (position, score) and keep the
        # last of each position (plain fancy assignment leaves repeated indices unspecified).
        order = np.lexsort((score, pos))
        pos, score = pos[order], score[order]
        last = np.empty(pos.size, dtype=bool)
        last[-1] = True
        np.not_equal(pos[1:], pos[:-1], out=last[:-1])
        self.scores[pos[last]] = score[last]
        self.ranks[pos[last]] = lower[order][last] + 1

    def _check(self, ids: np.ndarray, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The positions of ``ids`` in the job and the losses as float64, checked."""
        ids, loss = report_arrays(ids, losses, SamplingError)
        pos = np.searchsorted(self.ids, ids)
        known = pos < self.ids.size
        known[known] = self.ids[pos[known]] == ids[known]
        if not bool(known.all()):
            bad = ids[~known][:3].tolist()
            raise SamplingError(
                f"report names rows {bad} that are not rows of this job; pass batch['_id'] "
                "of this job's own batches."
            )
        return pos, loss

    def probabilities(self, ranks: np.ndarray | None = None) -> np.ndarray:
        """The draw probability of each row (aligned with ``ids``): scores plus the
        flattening term, normalised; sums to 1, each entry at least :func:`floor`. With
        ``ranks`` (a copy of ``self.ranks`` from before): as they were then (an epoch's
        frozen distribution, resumed exactly)."""
        s = self.scores if ranks is None else np.where(ranks > 0, np.log(ranks - 1 + B0), PRIOR)
        c = FLATTEN * float(s.mean())
        p = s + c
        p /= p.sum()
        return p

    def state_dict(self) -> dict[str, Any]:
        """A plain dict to resume exactly, of bytes like the samplers' state: the ids as a
        serialized bitmap, the ranks compressed (a job's state travels in one message of the
        service, ``MAX_MESSAGE``)."""
        return {
            "version": _STATE_VERSION,
            "ids": bitmap_from_array(self.ids).serialize(),
            "ranks": zlib.compress(self.ranks.tobytes(), 1),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], *, rows: int | None = None) -> ImportanceScores:
        """Rebuild what :meth:`state_dict` returned; ``rows``: the job's rows, which the
        state's must number (checked before an array of them is made: a state comes from
        outside, and a few bytes of it can name 2**32 rows).

        Raises:
            SamplingError: ``state`` is not such a dict (other version, sizes, values), or
                not of ``rows`` rows.
        """
        try:
            version = state["version"]
            bitmap = BitMap.deserialize(_bounded(state["ids"], rows))
            if rows is not None and len(bitmap) != rows:
                raise ValueError(f"it names {len(bitmap)} rows, not the job's {rows}")
            ids = bitmap_to_array(bitmap).astype(np.int64)
            inflate = zlib.decompressobj()
            raw = inflate.decompress(state["ranks"], 4 * ids.size + 4)  # bounded: 4 B a row
            ranks = np.frombuffer(raw, dtype=np.int32)
        except (KeyError, TypeError, ValueError, zlib.error) as e:
            raise SamplingError(
                f"importance state is not from ImportanceScores.state_dict() ({e}); pass "
                "what state_dict() returned."
            ) from None
        if version != _STATE_VERSION:
            raise SamplingError(
                f"importance state version {version!r} is not {_STATE_VERSION}; it was saved "
                "by another tabloader version: re-register the job."
            )
        if ids.size != ranks.size or not bool(((ranks >= 0) & (ranks <= ROWS_MAX)).all()):
            raise SamplingError(
                "importance state has mismatched ids and ranks or ranks out of "
                f"[0, {ROWS_MAX}]; pass what state_dict() returned."
            )
        out = cls(ids)
        out.ranks = ranks.copy()
        reported = ranks > 0
        out.scores[reported] = np.log(ranks[reported] - 1 + B0)
        return out
