"""One open request: what opening a job asks for, made once where the job is opened, checked
there, and carried whole to the engine (``Loader.open``), in-process or through the loader
service.

:class:`OpenRequest` is the one place that declares an open's arguments: the job, the job
options given at the open (laid over the ones it was registered with, or over a whole
``spec``), the data-parallel ``rank`` and ``world_size``, ``prefetch``, ``lookahead``,
``epochs`` and a ``state`` to resume from. ``Loader.open``, ``RemoteLoader.open`` and
``JobDataset`` take its arguments as they are (``OpenRequest.make``) or the request itself.

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
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tabloader.catalog._errors import LoaderError, OptionError, ServiceError, TabloaderError
from tabloader.catalog._options import JOB_OPTIONS, JobSpec, check_options
from tabloader.catalog._settings import check_counts
from tabloader.engine._queue.ranks import resolve_rank

__all__ = ["OPEN_VERSION", "OpenRequest", "state_from_wire", "state_to_wire"]

OPEN_VERSION = 1  # of the wire encoding: both ends read the same
_COUNTS = ("prefetch", "lookahead", "epochs")
_WIRE_KEYS = frozenset({"v", "job", "options", "spec", "rank", "world_size", *_COUNTS, "state"})


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

    @classmethod
    def make(
        cls,
        job: str,
        *,
        spec: JobSpec | None = None,
        prefetch: int | None = None,
        lookahead: int | None = None,
        epochs: int | None = None,
        state: Mapping[str, Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        **options: Any,
    ) -> OpenRequest:
        """The request of ``open(job, ...)``'s arguments: the job options are keywords."""
        return cls(job, options, spec, rank, world_size, prefetch, lookahead, epochs, state)

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
    """A job state (``JobStream.state_dict()``) for a message: its ``remaining`` bitmap, and
    an importance job's scores (``ImportanceScores.state_dict()``: bytes), in hex.

    Raises:
        LoaderError: ``state`` is not one.
    """
    try:
        wire = {**state, "remaining": bytes(state["remaining"]).hex()}
        if state.get("importance") is not None:
            wire["importance"] = {
                k: v.hex() if isinstance(v, bytes) else v for k, v in state["importance"].items()
            }
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
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise LoaderError(f"Not a job state: {exc!r}; pass what state_dict() returned.") from exc
    return out


def _malformed(what: str) -> ServiceError:
    return ServiceError(
        f"The loader service got a malformed open request ({what}); run the same tabloader on "
        "both ends (restart the service after an upgrade)."
    )
