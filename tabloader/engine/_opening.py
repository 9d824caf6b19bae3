"""One open request: what opening a job asks for, made once where the job is opened, checked
there, and carried whole to the engine (``Loader.open``), in-process or through the loader
service.

:class:`OpenRequest` is the one place that declares an open's arguments: the job, the job
options given at the open (laid over the ones it was registered with, or over a whole
``spec``), the data-parallel ``rank`` and ``world_size``, ``prefetch``, ``lookahead``,
``epochs`` and a ``state`` to resume from. ``Loader.open``, ``RemoteLoader.open`` and
``JobDataset`` take its arguments as they are (:class:`OpenArgs`, typed: ``OpenRequest.make``)
or the request itself.

Checks: each argument is checked as it is made (an unknown option with the closest known
one, a bad count, a rank outside its world); the options given are merged with the registered
ones, and that merge checked, once, by the engine that knows them (``resolve_spec``). The ranks
are found from the launcher of the process that opens the job (``resolved()``), never in the
service's. Through the service the request travels as :meth:`OpenRequest.to_wire`, read back by
:meth:`OpenRequest.from_wire`, which checks every field: a malformed one is a ``ServiceError``
naming it, never a ``KeyError`` or ``TypeError`` in the engine.
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import numpy.typing as npt
from pyroaring import BitMap

from tabloader.catalog._bitmaps import bitmap_from_array, bitmap_to_array, serialized_max
from tabloader.catalog._errors import (
    LoaderError,
    OptionError,
    SamplingError,
    ServiceError,
    TabloaderError,
)
from tabloader.catalog._options import JOB_OPTIONS, JobOptions, JobSpec, check_options
from tabloader.catalog._settings import SETTINGS, check_counts
from tabloader.engine._queue.ranks import resolve_rank
from tabloader.sampling._importance import ROWS_MAX, ImportanceScores
from tabloader.sampling._states import Drawn

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from tabloader.catalog import Job

OPEN_VERSION = 1  # of the wire encoding: both ends read the same
EPOCH_MAX = int(SETTINGS["epochs"].bounds()[1])
"""Epochs are numbered below this (the ``epochs`` setting's maximum), a resumed one too."""
_SEGMENTS = 64  # epochs a weighted job's state may have drawn ahead into (its queue's)
_STREAM = (1 << 128, 1 << 32, 1 << 62)  # a stream's entropy, key and round are below these
_COUNTS = ("prefetch", "lookahead", "epochs")
_WIRE_KEYS = frozenset({"v", "job", "options", "spec", "rank", "world_size", *_COUNTS, "state"})


class OpenArgs(JobOptions, total=False):
    """An open's keyword arguments (``Loader.open``, ``RemoteLoader.open``, ``JobDataset``):
    the job options (:class:`~tabloader.catalog.JobOptions`) and the open's own, each as
    :class:`OpenRequest` has it (None: not given)."""

    spec: JobSpec | None
    rank: int | None
    world_size: int | None
    prefetch: int | None
    lookahead: int | None
    epochs: int | None
    state: Mapping[str, Any] | None


_OWN = ("spec", "rank", "world_size", "prefetch", "lookahead", "epochs", "state")
"""The open's own arguments (:class:`OpenArgs` beyond the job options)."""


@dataclass(frozen=True)
class OpenRequest:
    """A job's open: the arguments of ``Loader.open`` (see there for what each means).

    Attributes:
        job: the registered job's name.
        options: the job options given at the open (None values left out), each checked
            against ``JOB_OPTIONS``; ``image_size`` may be a ``(height, width)`` pair.
        spec: the job's options instead of the registered ones (None: those).
        rank, world_size: this stream's place among the job's data-parallel ranks; None
            (both): found from the launcher when the request is ``resolved()``.
        prefetch, lookahead, epochs: as ``Loader.open``'s (None: the defaults).
        state: a ``state_dict()`` to resume from.

    Raises:
        OptionError: an unknown option (with the closest known one) or a bad value.
        LoaderError: a bad count, or ranks that are not ``0 <= rank < world_size``.
    """

    job: str
    options: Mapping[str, Any] = field(default_factory=dict)
    spec: JobSpec | None = None
    rank: int | None = None
    world_size: int | None = None
    prefetch: int | None = None
    lookahead: int | None = None
    epochs: int | None = None
    state: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not self.job:
            raise LoaderError(f"A job to open is named by a non-empty string, not {self.job!r}.")
        try:
            given = _given(self.options)
        except OptionError as exc:  # which open's arguments
            args = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if v is not None)
            raise OptionError(f"open({args}): {exc}") from None
        object.__setattr__(self, "options", MappingProxyType(given))
        if self.spec is not None and not isinstance(self.spec, JobSpec):
            raise LoaderError(
                f"spec= takes a JobSpec, not {type(self.spec).__name__}; pass job options "
                "as keyword arguments."
            )
        check_counts(LoaderError, **{name: getattr(self, name) for name in _COUNTS})
        if self.rank is not None or self.world_size is not None:
            resolve_rank(self.rank, self.world_size)  # both, in range (it raises)
        if self.state is not None:
            check_state(self.state, self.epochs)

    @classmethod
    def make(cls, job: str, **args: Unpack[OpenArgs]) -> OpenRequest:
        """The request of ``open(job, ...)``'s arguments: the job options are keywords."""
        given: dict[str, Any] = dict(args)
        own = {name: given.pop(name, None) for name in _OWN}
        return cls(job, given, **own)

    def resolved(self) -> OpenRequest:
        """This request with ``rank`` and ``world_size`` found from what launched this process
        if they were not given (``tabloader.engine._queue.ranks``)."""
        if self.rank is not None:
            return self
        rank, world_size = resolve_rank(None, None)
        return dataclasses.replace(self, rank=rank, world_size=world_size)

    def resolve_spec(self, registered: Mapping[str, Any]) -> JobSpec:
        """The job's options: the options given laid over ``spec`` (else the ``registered``
        ones), checked as ``REGISTER`` checks them (``JobSpec.from_options``): the one check of
        the whole set, by the engine that knows the registered options."""
        if self.spec is not None and not self.options:
            return self.spec  # checked whole where it was made
        base = registered if self.spec is None else self.spec.values
        return JobSpec.from_options(base, **self.options)

    def resume(self, job: Job, spec: JobSpec) -> Resume | None:
        """Where ``job`` (opened with ``spec``) resumes: the request's ``state`` checked
        against the job's rows, every size before anything of that size is made (None: a
        fresh start).

        Raises:
            LoaderError: the state is of another job, or its rows (or its importance scores)
                are not the job's.
        """
        if self.state is None:
            return None
        state, rows = self.state, len(job.ids)
        if state["job"] != job.name:
            raise LoaderError(f"The state is of job {str(state['job'])[:80]!r}, not {job.name!r}.")
        remaining = _bitmap(state["remaining"], rows, "rows")
        if remaining is None or not remaining or not remaining.issubset(job.ids):
            raise LoaderError(
                f"The state's rows are not a non-empty subset of job {job.name!r}'s rows; was "
                "the job re-registered since? Start it without a state."
            )
        scores = None
        saved = state.get("importance")
        if saved is not None and spec.importance == "loss":
            scores = _scores(saved, job)
        drawn = None
        if state.get("draws") is not None and (spec.weight or spec.importance) is not None:
            drawn = _drawn(state["draws"], job, int(state["epoch"]), remaining, self.epochs)
        return Resume(remaining, int(state["epoch"]), scores, drawn)

    # -- the wire ----------------------------------------------------------------------------
    def to_wire(self) -> dict[str, Any]:
        """The request as JSON values (its ranks ``resolved()`` first: they are this
        process's)."""
        req = self.resolved()
        return {
            "v": OPEN_VERSION,
            "job": req.job,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in req.options.items()},
            "spec": None if req.spec is None else req.spec.to_wire(),
            "rank": req.rank,
            "world_size": req.world_size,
            **{name: getattr(req, name) for name in _COUNTS},
            "state": None if req.state is None else state_to_wire(req.state),
        }

    @classmethod
    def from_wire(cls, wire: Any) -> OpenRequest:
        """The request that ``to_wire()`` made, each field checked.

        Raises:
            ServiceError: not that form, or a field the other end could not have sent (it
                names the field): another tabloader on the other end.
        """
        if not isinstance(wire, Mapping) or set(wire) != _WIRE_KEYS:
            keys = sorted(map(str, wire)) if isinstance(wire, Mapping) else type(wire).__name__
            raise _malformed(f"not an open request: {str(keys)[:120]}")
        if type(wire["v"]) is not int or wire["v"] != OPEN_VERSION:
            raise _malformed(
                f"an open request of version {str(wire['v'])[:20]}, not {OPEN_VERSION}"
            )
        for name in ("rank", "world_size"):
            if type(wire[name]) is not int:
                raise _malformed(f"{name} is {str(wire[name])[:20]}, not an integer")
        for name in _COUNTS:
            if wire[name] is not None and type(wire[name]) is not int:
                raise _malformed(f"{name} is {str(wire[name])[:20]}, not an integer or null")
        options = wire["options"]
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            raise _malformed(f"options are {str(options)[:80]}, not an object")
        try:
            spec = None if wire["spec"] is None else JobSpec.from_wire(wire["spec"])
            state = None if wire["state"] is None else state_from_wire(wire["state"])
            return cls(
                wire["job"],
                {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()},
                spec,
                wire["rank"],
                wire["world_size"],
                wire["prefetch"],
                wire["lookahead"],
                wire["epochs"],
                state,
            )
        except ServiceError:
            raise
        except TabloaderError as exc:  # the client checked all this: not our tabloader
            raise _malformed(str(exc)) from None


class Resume(NamedTuple):
    """Where a job resumes (``OpenRequest.resume``): the rows of ``epoch`` it has left, an
    importance job's scores and a weighted job's draws (None: none saved, or not such a
    job)."""

    remaining: BitMap
    epoch: int
    scores: ImportanceScores | None
    drawn: Drawn | None = None


def check_state(state: Any, epochs: int | None) -> None:
    """Check what a resume ``state`` says on its own, where the open request is made: its
    form, an epoch that is a whole number from 0 to ``epochs`` (``EPOCH_MAX - 1`` without),
    and bytes where its bitmaps go. Their sizes are checked against the job's rows when the
    job is known (``OpenRequest.resume``).

    Raises:
        LoaderError: a state that ``state_dict()`` did not return, naming the field.
    """
    if not isinstance(state, Mapping):
        raise _not_a_state(f"a {type(state).__name__}")
    for key in ("job", "epoch", "remaining"):
        if key not in state:
            raise _not_a_state(f"KeyError({key!r})")
    epoch, top = state["epoch"], EPOCH_MAX - 1 if epochs is None else epochs
    if not _whole(epoch) or not 0 <= epoch <= top:
        within = f"epochs={epochs}" if epochs is not None else "no epochs given"
        raise LoaderError(
            f"The state's epoch {str(epoch)[:40]} is not an epoch from 0 to {top} ({within}); "
            "pass what state_dict() returned, and epochs= at least its epoch."
        )
    if not isinstance(state["remaining"], bytes | bytearray | memoryview):
        raise _not_a_state(f"'remaining' is a {type(state['remaining']).__name__}, not bytes")
    saved = state.get("importance")
    if saved is not None and not (
        isinstance(saved, Mapping)
        and all(isinstance(saved.get(k), bytes | bytearray) for k in ("ids", "ranks"))
    ):
        raise _not_a_state(f"'importance' is {str(saved)[:60]}, not scores' state_dict()")
    draws = state.get("draws")
    if draws is not None and not (
        isinstance(draws, Mapping) and isinstance(draws.get("rows"), bytes | bytearray)
    ):
        raise _not_a_state(f"'draws' are {str(draws)[:60]}, not a weighted job's")


def _whole(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _not_a_state(what: str) -> LoaderError:
    return LoaderError(f"Not a job state: {what}; pass what state_dict() returned.")


def _bitmap(data: bytes, rows: int, what: str) -> BitMap | None:
    """A state's serialized bitmap of at most ``rows`` ids, its size checked before it is
    read and its count before any array is made of it (None: more than that)."""
    if len(data) > serialized_max(rows):
        return None
    try:
        bitmap = BitMap.deserialize(bytes(data))
    except (ValueError, TypeError) as exc:
        raise _not_a_state(f"its {what} are no bitmap ({exc})") from None
    return bitmap if len(bitmap) <= rows else None


def _scores(saved: Mapping[str, Any], job: Job) -> ImportanceScores:
    """An importance job's scores from its state, of the job's rows (``ImportanceScores``
    checks their sizes against them before it makes an array)."""
    try:
        scores = ImportanceScores.from_state(saved, rows=len(job.ids))
    except SamplingError as exc:
        raise LoaderError(f"The state's importance scores are bad: {exc}") from None
    if not np.array_equal(scores.ids, bitmap_to_array(job.ids)):
        raise LoaderError(
            f"The state's importance scores are of other rows than job {job.name!r}'s; was the "
            "job re-registered since? Start it without a state."
        )
    return scores


def _drawn(
    saved: Mapping[str, Any], job: Job, epoch: int, remaining: BitMap, epochs: int | None
) -> Drawn:
    """A weighted job's draws from its state (``Dealer._drawn``), every size checked before
    an array of it is made; the draws of epochs past ``epochs`` are left out.

    Raises:
        LoaderError: not draws a run of the job made (the sampler checks the rows' order).
    """
    rows, epochs_of, frozen = saved["rows"], saved.get("epochs"), saved.get("frozen")
    given: list[Any] = [saved.get(k) for k in ("entropy", "key", "round")]
    if not all(_whole(v) and 0 <= v < top for v, top in zip(given, _STREAM, strict=True)):
        raise _not_a_state(f"the draws' stream is {str(given)[:80]}")
    entropy, key, at = (int(v) for v in given)
    pairs = epochs_of if isinstance(epochs_of, list) and len(epochs_of) <= _SEGMENTS else None
    if pairs is None or not all(
        isinstance(p, list) and len(p) == 2 and all(_whole(v) and v >= 0 for v in p) for p in pairs
    ):
        raise _not_a_state(f"the draws' epochs are {str(epochs_of)[:80]}")
    n, counts = len(job.ids), [int(c) for _, c in pairs]
    # what each epoch has left at most (no pairs: nothing drawn yet, a state saved at once)
    tops = ([len(remaining)] + [n] * (len(pairs) - 1))[: len(pairs)]
    if (
        len(rows) % 4
        or len(rows) // 4 != sum(counts)
        or [int(e) for e, _ in pairs] != list(range(epoch, epoch + len(pairs)))
        or any(not 0 < c <= top for c, top in zip(counts, tops, strict=True))
        or any(c != top for c, top in zip(counts[:-1], tops[:-1], strict=True))
    ):
        raise _not_a_state(f"the draws' epochs {str(pairs)[:60]} and their rows disagree")
    drawn = np.frombuffer(rows, "<u4").astype(np.int64)
    if drawn.size and not bitmap_from_array(drawn).issubset(job.ids):
        raise _not_a_state(f"the draws are not rows of job {job.name!r}")
    if epochs is not None:  # the run went further than this open reads
        pairs = [p for p in pairs if p[0] < epochs]
    cuts = np.cumsum([0, *(c for _, c in pairs)])
    segments = [(int(e), drawn[a:b]) for (e, _), a, b in zip(pairs, cuts, cuts[1:], strict=False)]
    return Drawn(entropy, key, at, segments, _frozen(frozen, epoch, epoch + len(pairs), n))


def _frozen(frozen: Any, first: int, end: int, rows: int) -> dict[int, npt.NDArray[np.int32]]:
    """An importance job's frozen ranks of epochs ``first`` to ``end`` from its state's draws,
    decompressed to at most their ``rows`` values."""
    if frozen is None:
        return {}
    if not isinstance(frozen, list) or len(frozen) > _SEGMENTS:
        raise _not_a_state(f"the draws' frozen ranks are {str(frozen)[:60]}")
    out = {}
    for pair in frozen:
        if not (isinstance(pair, list) and len(pair) == 2 and _whole(pair[0])):
            raise _not_a_state(f"the draws' frozen ranks are {str(pair)[:60]}")
        try:
            raw = zlib.decompressobj().decompress(pair[1], 4 * rows + 4)
        except (TypeError, zlib.error) as exc:
            raise _not_a_state(f"the draws' frozen ranks are not compressed ({exc})") from None
        ranks = np.frombuffer(raw, np.int32)
        if ranks.size != rows or not bool(((ranks >= 0) & (ranks <= ROWS_MAX)).all()):
            raise _not_a_state(f"the draws' frozen ranks are not {rows} ranks")
        if first <= pair[0] < end:
            out[int(pair[0])] = ranks.copy()
    return out


def _given(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options given at an open (None: not given), each checked on its own: how they
    combine with the registered ones is checked where those are known (``resolve_spec``)."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            continue
        option = JOB_OPTIONS.get(key.lower()) if isinstance(key, str) else None
        if option is None:
            check_options({key: value})  # raises, naming the closest known option
            raise AssertionError(key)  # pragma: no cover - check_options raised
        if isinstance(value, enum.Enum):  # ``OnError``: its value, as a WITH option
            value = value.value
        if option.name == "image_size" and isinstance(value, tuple | list) and len(value) == 2:
            out[option.name] = tuple(option.check(side) for side in value)
        else:
            out[option.name] = option.check(value)
    return out


def state_to_wire(state: Mapping[str, Any]) -> dict[str, Any]:
    """A job state (``JobStream.state_dict()``) for a message: its ``remaining`` bitmap, an
    importance job's scores (``ImportanceScores.state_dict()``: bytes) and a weighted job's
    draws (rows and frozen ranks: bytes), in hex.

    Raises:
        LoaderError: ``state`` is not one.
    """
    try:
        wire = {**state, "remaining": bytes(state["remaining"]).hex()}
        if state.get("importance") is not None:
            wire["importance"] = {
                k: v.hex() if isinstance(v, bytes) else v for k, v in state["importance"].items()
            }
        if state.get("draws") is not None:
            draws = state["draws"]
            frozen = [[e, bytes(r).hex()] for e, r in draws.get("frozen") or ()]
            wire["draws"] = {**draws, "rows": bytes(draws["rows"]).hex(), "frozen": frozen}
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise LoaderError(f"Not a job state: {exc!r}; pass what state_dict() returned.") from exc
    return wire


def state_from_wire(state: Any) -> dict[str, Any]:
    """The job state that ``state_to_wire`` put in a message.

    Raises:
        LoaderError: ``state`` is not one.
    """
    try:
        out = {**state, "remaining": bytes.fromhex(state["remaining"])}
        if state.get("importance") is not None:
            scores = state["importance"]
            out["importance"] = {**scores, "ids": bytes.fromhex(scores["ids"])}
            out["importance"]["ranks"] = bytes.fromhex(scores["ranks"])
        if state.get("draws") is not None:
            draws = state["draws"]
            frozen = [[e, bytes.fromhex(r)] for e, r in draws.get("frozen") or ()]
            out["draws"] = {**draws, "rows": bytes.fromhex(draws["rows"]), "frozen": frozen}
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise LoaderError(f"Not a job state: {exc!r}; pass what state_dict() returned.") from exc
    return out


def _malformed(what: str) -> ServiceError:
    return ServiceError(
        f"The loader service got a malformed open request ({what}); run the same tabloader on "
        "both ends (restart the service after an upgrade)."
    )
