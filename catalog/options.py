"""Job options: the one table of the ``WITH (key = value)`` keys a job may carry.

``REGISTER JOB`` checks every option against ``JOB_OPTIONS`` (its type, its range, and for
``image_size`` the memory one batch of such images takes) and stores it typed; the loader
reads a job's options through ``option_value``, so the defaults live here too. An unknown key
is refused with the closest known one.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from catalog.augment import parse_augment
from catalog.errors import OptionError

__all__ = [
    "BATCH_BYTES_LIMIT",
    "JOB_OPTIONS",
    "JobOption",
    "check_open",
    "check_options",
    "option_value",
]

BATCH_BYTES_LIMIT = 4 << 30
"""The most bytes one batch of decoded ``image_size`` images (H x W x 3 bytes each) may take."""


@dataclass(frozen=True)
class JobOption:
    """One job option.

    Attributes:
        name: the key in ``WITH (...)``.
        type: ``int`` or ``str``.
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
        if self.parse is not None:
            return self.parse(value)
        if not isinstance(value, str) or value.lower() not in self.choices:
            raise OptionError(
                f"Job option {self.name} = {_sql(value)} is not one of "
                f"{', '.join(repr(c) for c in self.choices)}; {self.help}, {fix}."
            )
        return value.lower()


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
            "(see catalog.augment)",
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
    )
}


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
    return out


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


def check_open(options: Mapping[str, Any], **given: Any) -> dict[str, Any]:
    """A job's stored ``options`` with the values ``given`` at open (None: not given) laid over
    them, checked as ``REGISTER`` checks them: an open cannot ask for what ``REGISTER`` would
    refuse. ``image_size`` may also be a ``(height, width)`` pair at open.

    Raises:
        OptionError: as ``check_options``, naming the open argument.
    """
    given = {k: v for k, v in given.items() if v is not None}
    merged = {**options, **given}
    if "augment" in given and "image_size" not in given:  # one replaces the other
        merged.pop("image_size", None)
    if "image_size" in given and "augment" not in given:
        merged.pop("augment", None)
    pair = merged.get("image_size")
    if isinstance(pair, tuple | list) and len(pair) == 2:
        merged.pop("image_size")
    try:
        out = check_options(merged)
        if "image_size" not in out and pair is not None:
            height, width = (JOB_OPTIONS["image_size"].check(side) for side in pair)
            _check_batch_bytes(option_value(out, "batch_size"), height, width)
            out["image_size"] = (height, width)
    except OptionError as exc:
        args = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise OptionError(f"open({args}): {exc}") from None
    return out
