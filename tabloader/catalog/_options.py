"""Job options: the one table of the ``WITH (key = value)`` keys a job may carry.

``REGISTER JOB`` checks every option against ``JOB_OPTIONS`` (its type, its range, and for
``image_size`` the memory one batch of such images takes) and stores it typed. An open lays
its own values over them into a ``JobSpec``, which carries them to the engine (over the
service's wire and into a Ray cluster too) and gives each option's default from here. An
unknown key is refused with the closest known one. Adding an option is one row here plus the
code that uses it: no signature names the options one by one.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypedDict

from tabloader.catalog._augment import parse_augment
from tabloader.catalog._errors import OptionError, TabloaderError

BATCH_BYTES_LIMIT = 4 << 30
"""The most bytes one batch of decoded ``image_size`` images (H x W x 3 bytes each) may take."""


@dataclass(frozen=True)
class JobOption:
    """One job option.

    Attributes:
        name: the key in ``WITH (...)``.
        type: ``int``, ``str`` or ``bool`` (TRUE or FALSE in SQL, also 'true' or 'false').
        default: the loader's value when the job does not set it (None: none).
        help: what it does, for messages and docs.
        minimum: the smallest value of an ``int`` option.
        maximum: the largest value of an ``int`` option.
        choices: the values of a ``str`` option.
        example: a good value, shown in the fix of an error.
        parse: for a ``str`` option with a grammar of its own: text -> its canonical text
            (raising ``OptionError``), instead of ``choices``.
    """

    name: str
    type: type
    default: Any
    help: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    example: Any = None
    parse: Callable[[Any], str] | None = None

    def check(self, value: Any) -> Any:
        """Return ``value`` typed, or raise ``OptionError`` naming the key, value and fix."""
        fix = f"e.g. WITH ({self.name} = {_sql(self.example)})"
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionError(
                    f"Job option {self.name} = {_sql(value)} is not an integer; {self.help} is a "
                    f"whole number from {self.minimum} to {self.maximum}, {fix}."
                )
            if not (self.minimum or 0) <= value <= (self.maximum or value):
                raise OptionError(
                    f"Job option {self.name} = {value} is out of range; {self.help} is a whole "
                    f"number from {self.minimum} to {self.maximum}, {fix}."
                )
            return int(value)
        if self.type is bool:
            return _boolean(self, value, fix)
        if self.parse is not None:
            return self.parse(value)
        if not isinstance(value, str) or value.lower() not in self.choices:
            raise OptionError(
                f"Job option {self.name} = {_sql(value)} is not one of "
                f"{', '.join(repr(c) for c in self.choices)}; {self.help}, {fix}."
            )
        return value.lower()


def _boolean(option: JobOption, value: Any, fix: str) -> bool:
    """``value`` as a bool: True or False, or their text (a client that sends strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise OptionError(
        f"Job option {option.name} = {_sql(value)} is not TRUE or FALSE; {option.help}, {fix}."
    )


def _sql(value: Any) -> str:
    """``value`` as written in ``WITH (...)``."""
    if isinstance(value, bool):
        return str(value).upper()
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


JOB_OPTIONS: dict[str, JobOption] = {
    o.name: o
    for o in (
        JobOption(
            "batch_size",
            int,
            32,
            "rows per batch",
            minimum=1,
            maximum=1 << 16,
            example=32,
        ),
        JobOption(
            "image_size",
            int,
            None,
            "the shared resize of image columns (shorter side, then center crop)",
            minimum=1,
            maximum=1 << 15,
            example=224,
        ),
        JobOption(
            "seed",
            int,
            None,
            "the seed of the job's augmentation generator",
            minimum=0,
            maximum=2**63 - 1,
            example=0,
        ),
        JobOption(
            "augment",
            str,
            None,
            "the job's own random transforms of image columns, drawn per row and epoch "
            "(see tabloader.catalog._augment)",
            example="RandomResizedCrop(224), RandomHorizontalFlip()",
            parse=lambda text: parse_augment(text).text,
        ),
        JobOption(
            "decode_size",
            int,
            None,
            "the largest shorter side an augmented job's shared decode keeps (FFCV's maximum "
            "resolution; default: as decoded)",
            minimum=1,
            maximum=1 << 15,
            example=256,
        ),
        JobOption(
            "on_error",
            str,
            "raise",
            "what to do with a row that fails to read or decode",
            choices=("raise", "skip"),
            example="skip",
        ),
        JobOption(
            "rank_timeout",
            int,
            45,
            "the seconds a data-parallel rank waits for a rank that never opened the job "
            "before it raises",
            minimum=1,
            maximum=86_400,
            example=120,
        ),
        JobOption(
            "drop_last",
            bool,
            True,
            "whether data-parallel ranks drop an epoch's last rows that do not fill a batch on "
            "every rank (FALSE: pad the ranks' shares with repeated rows, for evaluation)",
            example=False,
        ),
        JobOption(
            "weight",
            str,
            None,
            "each row's weight in the job's draws, a SQL expression over the dataset's "
            "queryable columns (evaluated at REGISTER: non-negative, finite, not all zero)",
            example="CASE WHEN source = 'web' THEN 0.3 ELSE 1.0 END",
            parse=lambda text: _expression(JOB_OPTIONS["weight"], text),
        ),
        JobOption(
            "importance",
            str,
            None,
            "where the job's per-row importance comes from (SHADE: the losses the training "
            "loop reports with JobDataset.report)",
            choices=("loss",),
            example="loss",
        ),
        JobOption(
            "replacement",
            bool,
            True,
            "whether a weighted job's epoch draws len(job) rows with replacement (TRUE, as "
            "WeightedRandomSampler) or an order drawn by weight with every row once (FALSE)",
            example=False,
        ),
    )
}

WEIGHT_CHARS = 4096
"""The longest ``weight`` expression (the predicate's statement limits apply at REGISTER)."""


def _expression(option: JobOption, value: Any) -> str:
    """A ``weight`` expression as given: non-empty text of at most ``WEIGHT_CHARS``. Its
    columns and functions are checked at REGISTER, against the dataset."""
    if not isinstance(value, str) or not value.strip() or len(value) > WEIGHT_CHARS:
        raise OptionError(
            f"Job option {option.name} = {_sql(value)[:60]} is not a SQL expression of 1 to "
            f"{WEIGHT_CHARS} characters; {option.help}, e.g. WITH ({option.name} = "
            f"{_sql(option.example)})."
        )
    return value.strip()


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check job options against ``JOB_OPTIONS``; return them typed, in the order given.

    Raises:
        OptionError: an unknown key (with the closest known one), a value of the wrong type
            or out of range, or an ``image_size`` whose batch would exceed
            ``BATCH_BYTES_LIMIT``.
    """
    out: dict[str, Any] = {}
    for key, value in (options or {}).items():
        option = JOB_OPTIONS.get(key.lower()) if isinstance(key, str) else None
        if option is None:
            close = difflib.get_close_matches(str(key).lower(), JOB_OPTIONS, n=1, cutoff=0.6)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise OptionError(
                f"Unknown job option '{key}'.{hint} Job options: {', '.join(JOB_OPTIONS)}."
            )
        out[option.name] = option.check(value)
    batch = out.get("batch_size", JOB_OPTIONS["batch_size"].default)
    if out.get("augment") is not None and out.get("image_size") is not None:
        raise OptionError(
            "Job options augment and image_size are both set: augment's operations decide "
            "the size; drop image_size (add CenterCrop or Resize((h, w)) to augment instead)."
        )
    if out.get("augment") is not None:
        spec = parse_augment(out["augment"])
        need = batch * spec.output_bytes
        if need > BATCH_BYTES_LIMIT:
            raise OptionError(
                f"Job option augment makes one batch of {batch} images {need / 2**30:.1f} GiB "
                f"({spec.output_bytes} bytes each), over the {BATCH_BYTES_LIMIT >> 30} GiB "
                "limit for one batch; use a smaller output size or batch_size."
            )
    size = out.get("image_size")
    if size is not None:
        _check_batch_bytes(batch, size, size)
    _check_weighting(out)
    return out


def _check_weighting(out: Mapping[str, Any]) -> None:
    """Refuse ``weight`` with ``importance``, and ``replacement`` on a job that is neither."""
    if out.get("weight") is not None and out.get("importance") is not None:
        raise OptionError(
            "Job options weight and importance are both set: a job draws either by fixed "
            "weights or by the importance of its reported losses; drop one of them."
        )
    if "replacement" in out and out.get("weight") is None and out.get("importance") is None:
        raise OptionError(
            f"Job option replacement = {_sql(out['replacement'])} is set on a job without "
            "weight or importance: a plain job's epoch is a permutation, every row once; "
            "drop replacement, or set weight = '<expression>' or importance = 'loss'."
        )


def _check_batch_bytes(batch: int, height: int, width: int) -> None:
    """Refuse a batch of ``batch`` images of ``height`` x ``width`` over ``BATCH_BYTES_LIMIT``."""
    need = batch * height * width * 3
    if need > BATCH_BYTES_LIMIT:
        largest = math.isqrt(BATCH_BYTES_LIMIT // (3 * batch))
        raise OptionError(
            f"Job option image_size = {height if height == width else (height, width)} makes "
            f"one batch of {batch} images {need / 2**30:.1f} GiB ({height}x{width}x3 bytes "
            f"each), over the {BATCH_BYTES_LIMIT >> 30} GiB limit for one batch; use "
            f"image_size <= {largest} with batch_size = {batch}, or a smaller batch_size."
        )


def option_value(options: Mapping[str, Any], name: str) -> Any:
    """The value of job option ``name`` in a job's ``options``, else its default.

    A job stored by an older tabloader may hold an unchecked value: it is checked here.
    """
    option = JOB_OPTIONS[name]
    value = options.get(name)
    return option.default if value is None else option.check(value)


SERVICE_BATCHES = 3
"""The fewest batches of a job that a loader service's cache holds at once (one prepared
ahead, one at the client, one it reads ahead: ``tabloader.engine._queue.jobs.fit_prefetch``)."""


def default_cache_problem(name: str, options: Mapping[str, Any], rows: int) -> str | None:
    """Why a loader service with the default cache (``cache_bytes``) could not serve job
    ``name`` (checked ``options``, ``rows`` rows): even its real batch (the smaller of
    ``batch_size`` and ``rows``) takes more than a third of the cache. None if it fits, if
    the images keep their own size (nothing to estimate), or if the setting is malformed
    (the service says so when it starts)."""
    from tabloader.catalog._settings import format_bytes, setting

    if options.get("augment") is not None:
        one = parse_augment(options["augment"]).output_bytes
    elif options.get("image_size") is not None:
        size = options["image_size"]
        one = 3 * (size * size if isinstance(size, int) else math.prod(size))
    else:
        return None
    batch = min(option_value(options, "batch_size"), rows)
    try:
        cache = int(setting("cache_bytes"))
    except TabloaderError:
        return None
    need = SERVICE_BATCHES * batch * one
    if need <= cache:
        return None
    return (
        f"Job '{name}': a batch of {batch} rows takes {format_bytes(batch * one)} of decoded "
        f"images and a loader service holds {SERVICE_BATCHES} at once, more than the default "
        f"cache of {format_bytes(cache)}: a service started by default could not open the "
        f"job. Start it with --cache-bytes {-(-need >> 20)}MiB or more (or set "
        "$TABLOADER_CACHE_BYTES), or lower batch_size or the image size."
    )


SPEC_VERSION = 1
"""The version of ``JobSpec.to_wire()``'s form: ``JobSpec.from_wire`` refuses any other."""


class JobOptions(TypedDict, total=False):
    """The job options as an open's keyword arguments (``JOB_OPTIONS``, each typed; None: not
    given, the registered value holds): what ``Loader.open``, ``RemoteLoader.open`` and
    ``JobDataset`` take beside their own (``OpenArgs``), so that mypy and editors see
    ``batch_size=``. A row added to ``JOB_OPTIONS`` needs its line here (a test checks)."""

    batch_size: int | None
    image_size: int | tuple[int, int] | None
    seed: int | None
    augment: str | Any | None  # a text; ``JobDataset`` also takes a torchvision ``Compose``
    decode_size: int | None
    on_error: str | Any | None  # "raise" or "skip" (or ``tabloader.engine.OnError``)
    rank_timeout: int | None
    drop_last: bool | None
    weight: str | None
    importance: str | None
    replacement: bool | None


@dataclass(frozen=True)
class JobSpec:
    """A job's options, checked against ``JOB_OPTIONS``: what carries them from ``REGISTER``
    through an open (``Loader.open``, the service's wire, a Ray cluster) to the engine.

    Every option of the table is an attribute: ``spec.batch_size`` is the value set, else the
    table's default. Nothing here names an option: a row added to ``JOB_OPTIONS`` is carried
    end to end as it is.

    Attributes:
        values: the options set, checked and typed (``image_size`` may be a
            ``(height, width)`` pair, which only an open can ask for).

    Raises:
        OptionError: as ``check_options``.
    """

    values: Mapping[str, Any] = field(default_factory=dict)

    if TYPE_CHECKING:  # each option's type, for mypy (a misspelt one is an error there)
        batch_size: int = field(init=False)
        image_size: int | tuple[int, int] | None = field(init=False)
        seed: int | None = field(init=False)
        augment: str | None = field(init=False)
        decode_size: int | None = field(init=False)
        on_error: str = field(init=False)
        rank_timeout: int = field(init=False)
        drop_last: bool = field(init=False)
        weight: str | None = field(init=False)
        importance: str | None = field(init=False)
        replacement: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(_check_spec(self.values)))

    if not TYPE_CHECKING:  # at run time, every option of the table (typed above for mypy)

        def __getattr__(self, name: str) -> Any:
            option = JOB_OPTIONS.get(name)
            if option is None:  # also what copy and pickle look for before ``values`` is set
                raise AttributeError(
                    f"JobSpec has no option {name!r}; options: {', '.join(JOB_OPTIONS)}."
                )
            return self.values.get(name, option.default)

    def __repr__(self) -> str:
        return f"JobSpec({', '.join(f'{k}={v!r}' for k, v in self.values.items())})"

    def __reduce__(self) -> tuple[Any, ...]:
        return JobSpec, (dict(self.values),)

    def resolved(self) -> dict[str, Any]:
        """Every option of the table: its value set, else its default."""
        return {name: getattr(self, name) for name in JOB_OPTIONS}

    @classmethod
    def from_options(cls, stored: Mapping[str, Any], **overrides: Any) -> JobSpec:
        """A job's ``stored`` options with the ``overrides`` given at open (None: not given)
        laid over them, checked as ``REGISTER`` checks them: an open cannot ask for what
        ``REGISTER`` would refuse. ``augment`` given replaces a stored ``image_size`` and the
        other way round.

        Raises:
            OptionError: as ``check_options`` (an unknown name with the closest known one),
                naming the open's arguments.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        if "weight" in given and given["weight"] != stored.get("weight"):
            raise OptionError(
                f"open(weight={given['weight']!r}): a job's weights are evaluated at REGISTER "
                "and stored with it; REGISTER OR REPLACE JOB with WITH (weight = ...) instead."
            )
        merged = {**stored, **given}
        if "augment" in given and "image_size" not in given:  # one replaces the other
            merged.pop("image_size", None)
        if "image_size" in given and "augment" not in given:
            merged.pop("augment", None)
        try:
            return cls(merged)
        except OptionError as exc:
            args = ", ".join(f"{k}={v!r}" for k, v in given.items())
            raise OptionError(f"open({args}): {exc}") from None

    def to_wire(self) -> dict[str, Any]:
        """The spec as JSON values: ``{"v": SPEC_VERSION, "options": {...}}`` (the options set;
        tuples become lists)."""
        options = {k: list(v) if isinstance(v, tuple) else v for k, v in self.values.items()}
        return {"v": SPEC_VERSION, "options": options}

    @classmethod
    def from_wire(cls, wire: Any) -> JobSpec:
        """The spec that ``to_wire()`` made, checked again.

        Raises:
            OptionError: not that form, another ``SPEC_VERSION``, or options that the table
                refuses (an unknown one with the closest known one).
        """
        if not isinstance(wire, Mapping) or set(wire) != {"v", "options"}:
            raise OptionError(
                f"Not a job spec: {str(wire)[:80]}; send JobSpec.to_wire()'s "
                f"{{'v': {SPEC_VERSION}, 'options': {{...}}}}."
            )
        version, options = wire["v"], wire["options"]
        if type(version) is not int or version != SPEC_VERSION:
            raise OptionError(
                f"A job spec of version {version!r}; this tabloader reads version "
                f"{SPEC_VERSION}: run the same tabloader on both ends (restart the service "
                "after an upgrade)."
            )
        if not isinstance(options, Mapping):
            raise OptionError(f"A job spec's options are {type(options).__name__}, not a dict.")
        try:
            return cls({k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
        except OptionError as exc:
            raise OptionError(f"A job spec: {exc}") from None


def _check_spec(values: Mapping[str, Any]) -> dict[str, Any]:
    """``check_options`` that also takes a ``(height, width)`` pair for ``image_size``."""
    merged = dict(values)
    pair = merged.get("image_size")
    if isinstance(pair, tuple | list) and len(pair) == 2:
        merged.pop("image_size")
    else:
        pair = None
    out = check_options(merged)
    if pair is not None:
        if out.get("augment") is not None:
            raise OptionError(
                "Job options augment and image_size are both set: augment's operations decide "
                "the size; drop image_size."
            )
        height, width = (JOB_OPTIONS["image_size"].check(side) for side in pair)
        _check_batch_bytes(option_value(out, "batch_size"), height, width)
        out["image_size"] = (height, width)
    return out
