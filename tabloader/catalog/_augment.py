"""The ``augment`` job option: a job's own random transforms, as a small strict grammar.

A job that trains with the standard recipe declares it with the job::

    REGISTER JOB r18 SELECT image, label FROM imagenet
        WITH (augment = 'RandomResizedCrop(224), RandomHorizontalFlip()')

The text is a comma-separated list of operations with torchvision's names, arguments and
defaults. It is parsed with :mod:`ast` (never evaluated): only calls of the names below with
number, tuple and ``True``/``False`` arguments pass, so nothing in it can run code.

==================================================  ===========================================
operation                                           does (as ``torchvision.transforms.v2``)
==================================================  ===========================================
``RandomResizedCrop(size, scale=(0.08, 1.0),        a random area/aspect crop (10 tries, then a
ratio=(3/4, 4/3))``                             center crop), resized to ``size``
``Resize(size)``                                    shorter side to ``size`` (an int), or
                                                    exactly ``(h, w)``
``CenterCrop(size)``                                the central ``size`` (zero-padded if larger)
``RandomCrop(size, padding=None,                    a random ``size`` crop after padding with
pad_if_needed=False, fill=0)``                      ``fill``
``RandomHorizontalFlip(p=0.5)``                     mirror left-right with probability ``p``
``Normalize(mean, std)``                            last only: float32 channels-first batches
                                                    of ``(x / 255 - mean) / std``
==================================================  ===========================================

``size`` is an int (a square) or ``(h, w)``; ``RandomResizedCrop``'s ``scale`` is within
(0, 1] and its ``ratio`` within [1/100, 100] (each ``(low, high)`` with low <= high), and
``Normalize``'s values are float32 numbers with every ``std`` at least ``MIN_STD`` (1e-6) and
every output finite in float32. Resizes are bilinear with antialiasing (torch's
``interpolate(..., antialias=True)``, as torchvision's v2 on tensors). The output of the
pipeline must have one shape for every image (so that a batch is one array): the last op that
sets the size must be ``RandomResizedCrop``, ``CenterCrop``, ``RandomCrop`` or
``Resize((h, w))``. ``Normalize`` takes the place of torchvision's ``ToDtype(float32,
scale=True)`` + ``Normalize``: it divides by 255 itself.

**Bounds.** What a job's augmentation of one image may allocate is fixed when the text is parsed (so
``REGISTER``, the options given at open and the service refuse the same texts with the same
:class:`~tabloader.catalog._errors.OptionError`): at most ``MAX_OPS`` (16) operations, and no
intermediate image (a resize's output, a padded image) over ``MAX_PIXELS`` (2**26 pixels: 192 MiB of
uint8 RGB). The check walks the chain from a ``SOURCE_SIDE`` x ``SOURCE_SIDE`` (4096 x 4096, a large
photo) and from a 1 x 1 source (where ``pad_if_needed`` pads most) with
:meth:`AugmentSpec.intermediates`. An image's augmentation holds at most three intermediates at once
(a resize's input, its contiguous copy where the input is a mirrored view, and its output), so at
most 3 x 192 MiB besides its source (with tabloader's resize kernel; torch and Pillow, where it is
not built, copy once more). A source of another shape (a panorama under ``Resize(256)``) is checked
again, per image, by the engine before it allocates, with the same walk: that row fails with a
``RowReadError``.

The whole chain's work is bounded too, since the shared pool runs it for every row of the
job: :meth:`AugmentSpec.work` counts the pixels it reads and writes (each op that makes an
image reads its input and writes that image, and the output is written into the batch; a
crop or a flip is a view), walked as above, and a spec over ``MAX_WORK`` (2**28 pixels) is
refused. That is four intermediates of the largest size: a 4096 x 4096 source upscaled to
8192 x 8192 twice passes (218 M pixels), three times (352 M) does not, and a chain of 15 such
resizes (1963 M pixels: 2.8-3.5 s of CPU a row in the shared pool, though every intermediate
is within ``MAX_PIXELS``) is refused at ``REGISTER``. The usual recipes
(``RandomResizedCrop(224)``, ``Resize(256), CenterCrop(224)``) read a 4096 x 4096 source once:
17 M pixels, 1/16 of the limit. (A mirrored input's copy before a resize, at most one more
read of it, is not counted.) Other source shapes are bounded by their intermediates, checked
per image.

This module parses and checks (at ``REGISTER``, and for options given at open), writes the
text of a torchvision ``Compose`` (:func:`from_torchvision`) and names a job's default seed;
the draws and the pixels are :mod:`tabloader.engine._prepare.augment`'s (a job process that reads
through the service imports none of that).

Example:
    >>> spec = parse_augment("RandomResizedCrop(224, ratio=(0.75, 1.25)), RandomHorizontalFlip(1)")
    >>> spec.text
    'RandomResizedCrop(224, scale=(0.08, 1.0), ratio=(0.75, 1.25)), RandomHorizontalFlip(1.0)'
    >>> spec.output_shape, spec.need
    ((224, 224, 3), 224)
"""

from __future__ import annotations

import ast
import difflib
import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tabloader.catalog._errors import OptionError

MAX_TEXT = 2000
"""The longest ``augment`` text (characters): a parse is bounded."""

MAX_SIZE = 1 << 15
"""The largest size (pixels) an operation may ask for."""

MAX_OPS = 16
"""The most operations in one ``augment`` (each may allocate an image: the work is bounded)."""

MAX_PIXELS = 1 << 26
"""The most pixels of one intermediate image of an augmentation (a resize's output, a padded
image): 64 Mi pixels, 192 MiB as uint8 RGB (e.g. 8192 x 8192)."""

MAX_WORK = 1 << 28
"""The most pixels a whole ``augment`` chain may read and write for one image
(:meth:`AugmentSpec.work`, walked from a ``SOURCE_SIDE`` square): four times ``MAX_PIXELS``."""

SOURCE_SIDE = 4096
"""The side of the square source the check at parse walks a chain from (a 16.8-megapixel
photo); other sources are checked per image, before anything is allocated."""

MAX_RATIO = 100.0
"""``RandomResizedCrop``'s ``ratio`` bounds lie within [1 / MAX_RATIO, MAX_RATIO]."""

MIN_STD = 1e-6
"""The smallest ``Normalize`` std (a smaller one turns 8-bit pixels into noise or inf)."""

_FLOAT32_MAX = 3.4028234663852886e38

_FIX = "e.g. augment = 'RandomResizedCrop(224), RandomHorizontalFlip()'"


@dataclass(frozen=True)
class Op:
    """One operation: its name and its arguments, checked and complete (defaults filled)."""

    name: str
    args: tuple[tuple[str, Any], ...]

    def arg(self, key: str) -> Any:
        return self._kwargs[key]

    @functools.cached_property
    def _kwargs(self) -> dict[str, Any]:  # arg() is on the per-image path
        return dict(self.args)

    @property
    def size_hw(self) -> tuple[int, int]:
        """The op's ``size`` as ``(h, w)`` (an int is a square)."""
        return _pair(self.arg("size"))

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        """The op's output (h, w) for an ``h`` x ``w`` input (it does not depend on the draws).

        ``Resize`` with an int scales the shorter side (the longer truncated, as torchvision
        computes it); a pair, and the crops, give their size.
        """
        if self.name == "Resize":
            size = self.arg("size")
            if isinstance(size, tuple):
                return size
            return (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
        return self.size_hw if self.name in _FIXED else (h, w)

    def padding_for(self, h: int, w: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) that ``CenterCrop`` or ``RandomCrop`` pads an ``h`` x ``w``
        input with (torchvision's: ``pad_if_needed`` adds the shortfall on both sides)."""
        if self.name == "CenterCrop":
            th, tw = self.size_hw
            top, left = max(th - h, 0) // 2, max(tw - w, 0) // 2
            return left, top, max(tw - w, 0) - left, max(th - h, 0) - top
        left, top, right, bottom = self.arg("padding") or (0, 0, 0, 0)
        th, tw = self.size_hw
        if self.arg("pad_if_needed"):
            ph, pw = h + top + bottom, w + left + right
            if pw < tw:
                left, right = left + tw - pw, right + tw - pw
            if ph < th:
                top, bottom = top + th - ph, bottom + th - ph
        return left, top, right, bottom

    def allocates(self, h: int, w: int) -> tuple[int, int]:
        """The (h, w) of the image the op allocates for an ``h`` x ``w`` input: a resize's
        output or the padded input ((0, 0): only views, or written into the batch)."""
        if self.name == "RandomResizedCrop":  # its crop's size is drawn: always a resize
            return self.size_hw
        if self.name == "Resize":
            out = self.output_hw(h, w)
            return (0, 0) if out == (h, w) else out
        if self.name in ("CenterCrop", "RandomCrop"):
            left, top, right, bottom = self.padding_for(h, w)
            padded = left or top or right or bottom
            return (h + top + bottom, w + left + right) if padded else (0, 0)
        return (0, 0)

    @property
    def text(self) -> str:
        """The canonical text: the first argument positional, the rest by keyword."""
        parts = [
            _show(value) if i == 0 else f"{key}={_show(value)}"
            for i, (key, value) in enumerate(self.args)
        ]
        return f"{self.name}({', '.join(parts)})"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return repr(value)


@dataclass(frozen=True)
class AugmentSpec:
    """A parsed ``augment`` option: the ops in order.

    Attributes:
        ops: the operations.
        text: the canonical text (what the catalog stores and ``SHOW JOBS`` prints).
        output_shape: one output image's shape: ``(h, w, 3)`` uint8, or ``(3, h, w)`` float32
            with ``Normalize``.
        need: the shorter side the shared decode should keep at least for this job: the
            largest size any op asks for (so its crops are resized down, not up, from the
            usual image).
    """

    ops: tuple[Op, ...]

    @property
    def text(self) -> str:
        return ", ".join(op.text for op in self.ops)

    @property
    def normalized(self) -> bool:
        return bool(self.ops) and self.ops[-1].name == "Normalize"

    @property
    def output_shape(self) -> tuple[int, int, int]:
        h, w = _output_hw(self.ops)
        return (3, h, w) if self.normalized else (h, w, 3)

    @property
    def output_bytes(self) -> int:
        return math.prod(self.output_shape) * (4 if self.normalized else 1)

    @property
    def need(self) -> int:
        sizes = [max(op.size_hw) for op in self.ops if op.name in _SIZED]
        return max(sizes)

    def intermediates(self, h: int, w: int) -> list[tuple[Op, tuple[int, int]]]:
        """Each op with the (h, w) of the image it allocates ((0, 0): none) when the chain
        runs on an ``h`` x ``w`` source, in order."""
        out = []
        for op in self.ops:
            out.append((op, op.allocates(h, w)))
            h, w = op.output_hw(h, w)
        return out

    def work(self, h: int, w: int) -> int:
        """The pixels the chain reads and writes on an ``h`` x ``w`` source: each op that
        makes an image (:meth:`intermediates`) reads its input and writes that image, and
        the output is written into the batch (crops and flips are views)."""
        total = 0
        for op in self.ops:
            ah, aw = op.allocates(h, w)
            if ah:
                total += h * w + ah * aw
            h, w = op.output_hw(h, w)
        return total + h * w

    def check_source(self, h: int, w: int) -> str | None:
        """Why the chain may not run on an ``h`` x ``w`` source, or None when it may: an
        intermediate over ``MAX_PIXELS``, or a ``RandomCrop`` larger than its padded input (as
        torchvision, which raises then), named with the op, the sizes and the fix."""
        return self.check_intermediates(h, w) or self._check_crops(h, w)

    def check_intermediates(self, h: int, w: int) -> str | None:
        """Why the chain's intermediates may not be made from an ``h`` x ``w`` source (one over
        ``MAX_PIXELS``, named with its op and size), or None."""
        for op, (ah, aw) in self.intermediates(h, w):
            if ah * aw > MAX_PIXELS:
                return (
                    f"{op.text} makes a {ah} x {aw} image ({ah * aw} pixels, {_mib(ah * aw)}) "
                    f"from a {h} x {w} source, over the limit of {MAX_PIXELS} pixels "
                    f"({_mib(MAX_PIXELS)}) for one intermediate image; {_SHRINK[op.name]}"
                )
        return None

    def _check_crops(self, h: int, w: int) -> str | None:
        sh, sw = h, w
        for op in self.ops:
            if op.name == "RandomCrop":
                left, top, right, bottom = op.padding_for(h, w)
                ph, pw = h + top + bottom, w + left + right
                th, tw = op.size_hw
                if th > ph or tw > pw:
                    return (
                        f"{op.text} crops {th} x {tw} from a {ph} x {pw} image (padded, from a "
                        f"{sh} x {sw} source); give it pad_if_needed=True"
                    )
            h, w = op.output_hw(h, w)
        return None


_SHRINK = {
    "RandomResizedCrop": "use a smaller size",
    "Resize": "use a smaller size (or crop before resizing up)",
    "CenterCrop": "use a smaller size",
    "RandomCrop": "use a smaller size or padding",
}


def _mib(pixels: int) -> str:
    """The bytes of ``pixels`` uint8 RGB pixels, for a message."""
    size = pixels * 3 / 2**20
    return f"{size / 1024:.1f} GiB" if size >= 1024 else f"{size:.0f} MiB"


_SIZED = ("RandomResizedCrop", "Resize", "CenterCrop", "RandomCrop")
_FIXED = ("RandomResizedCrop", "CenterCrop", "RandomCrop")


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


def _output_hw(ops: tuple[Op, ...]) -> tuple[int, int]:
    for op in reversed(ops):
        if op.name in _FIXED or (op.name == "Resize" and isinstance(op.arg("size"), tuple)):
            return op.size_hw
        if op.name == "Resize":
            break
    raise OptionError(
        "augment's output size varies with the image: end the resizing with "
        "RandomResizedCrop, CenterCrop, RandomCrop or Resize((h, w)) so that every image of a "
        f"batch has one shape, {_FIX}."
    )


# name -> ((argument, default or _REQUIRED), ...) in torchvision's positional order
_REQUIRED = object()
OPERATIONS: dict[str, tuple[tuple[str, Any], ...]] = {
    "RandomResizedCrop": (
        ("size", _REQUIRED),
        ("scale", (0.08, 1.0)),
        ("ratio", (3 / 4, 4 / 3)),
    ),
    "Resize": (("size", _REQUIRED),),
    "CenterCrop": (("size", _REQUIRED),),
    "RandomCrop": (
        ("size", _REQUIRED),
        ("padding", None),
        ("pad_if_needed", False),
        ("fill", 0),
    ),
    "RandomHorizontalFlip": (("p", 0.5),),
    "Normalize": (("mean", _REQUIRED), ("std", _REQUIRED)),
}
"""The operations ``augment`` knows, with their arguments and defaults."""


def parse_augment(text: object) -> AugmentSpec:
    """Parse and check an ``augment`` text.

    Raises:
        OptionError: not a string, too long or nested too deeply, not a list of calls, more
            than ``MAX_OPS`` of them, an unknown operation (with the closest known one), a bad
            or missing argument (named), ``Normalize`` not last, an output size that varies
            with the image, an intermediate image over ``MAX_PIXELS``, or a chain that reads
            and writes over ``MAX_WORK`` pixels for one image.
    """
    if not isinstance(text, str):
        raise OptionError(f"Job option augment = {text!r} is not a string of operations, {_FIX}.")
    if len(text) > MAX_TEXT:
        raise OptionError(
            f"Job option augment is {len(text)} characters, over the {MAX_TEXT} allowed; "
            "list fewer operations."
        )
    if not text.strip():
        raise OptionError(f"Job option augment is empty; list operations, {_FIX}.")
    source = f"[{text}]"
    try:
        tree = ast.parse(source, mode="eval")
        assert isinstance(tree.body, ast.List)
        if len(tree.body.elts) > MAX_OPS:
            raise OptionError(
                f"Job option augment lists {len(tree.body.elts)} operations, over the {MAX_OPS} "
                "allowed; list fewer operations."
            )
        ops = tuple(_op(source, node) for node in tree.body.elts)
    except SyntaxError as exc:
        raise OptionError(
            f"Job option augment = {_clip(text)!r} is not a list of operations (column "
            f"{max((exc.offset or 2) - 1, 1)}: {exc.msg}), {_FIX}."
        ) from None
    except (RecursionError, MemoryError):  # Python's parser on deep nesting
        raise OptionError(
            f"Job option augment = {_clip(text)!r} nests too deeply to be a list of "
            f"operations, {_FIX}."
        ) from None
    for op in ops[:-1]:
        if op.name == "Normalize":
            raise OptionError(
                "augment: Normalize must be the last operation (it turns the images into "
                "float32 channels-first); move it to the end."
            )
    if ops[-1].name == "Normalize":
        _check_normalize(ops[-1])
    spec = AugmentSpec(ops)
    spec.output_shape  # noqa: B018 - raises for an output size that varies
    for side in (SOURCE_SIDE, 1):
        why = spec.check_intermediates(side, side)
        if why is not None:
            raise OptionError(f"augment: {why}.")
    _check_work(spec)
    return spec


def _check_work(spec: AugmentSpec) -> None:
    """Refuse a chain that reads and writes more than ``MAX_WORK`` pixels for one image
    (walked from a ``SOURCE_SIDE`` square and from a 1 x 1 source, where padding is largest)."""
    work, side = max((spec.work(side, side), side) for side in (SOURCE_SIDE, 1))
    if work > MAX_WORK:
        raise OptionError(
            f"augment = {_clip(spec.text, 80)!r} reads and writes {work / 1e6:.0f} M pixels for "
            f"one {side} x {side} image ({len(spec.ops)} operations), over the limit of "
            f"{MAX_WORK / 1e6:.0f} M pixels for a whole chain (the shared decode pool runs it "
            "for every row of the job); use fewer or smaller resizes (each reads its input and "
            f"writes its output), {_FIX}."
        )


def _check_normalize(op: Op) -> None:
    """Refuse a ``Normalize`` whose outputs ``(x / 255 - mean) / std`` (x in 0..255) may not
    be finite in float32 (with a factor 2 for its rounding)."""
    for c, (mean, std) in enumerate(zip(op.arg("mean"), op.arg("std"), strict=True)):
        top = (1 + abs(mean)) / std
        if top > _FLOAT32_MAX / 2:
            raise OptionError(
                f"augment: Normalize's channel {c} (mean {mean:g}, std {std:g}) makes values up "
                f"to {top:.3g}, past float32's range (at most {_FLOAT32_MAX / 2:.3g} here); use a "
                f"smaller mean or a larger std, e.g. {_EXAMPLE['Normalize']}."
            )


def _clip(text: str, most: int = 60) -> str:
    """``text`` for a message: at most ``most`` characters."""
    return text if len(text) <= most else f"{text[: most - 3]}..."


def _segment(source: str, node: ast.expr) -> str:
    """A node's text for a message (``ast.unparse`` recurses: a deep node would not print)."""
    return _clip(ast.get_source_segment(source, node) or "?")


def _op(source: str, node: ast.expr) -> Op:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise OptionError(
            f"augment: {_segment(source, node)!r} is not an operation call such as "
            f"RandomHorizontalFlip(0.5); known: {', '.join(OPERATIONS)}."
        )
    name = node.func.id
    params = OPERATIONS.get(name)
    if params is None:
        close = difflib.get_close_matches(name, OPERATIONS, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise OptionError(
            f"augment: unknown operation {name!r}.{hint} Known: {', '.join(OPERATIONS)}."
        )
    given: dict[str, Any] = {}
    names = [p for p, _ in params]
    if len(node.args) > len(params):
        raise OptionError(
            f"augment: {name} takes at most {len(params)} arguments ({', '.join(names)}), "
            f"got {len(node.args)}."
        )
    for (key, _), arg in zip(params, node.args, strict=False):
        given[key] = _literal(source, name, key, arg)
    for kw in node.keywords:
        if kw.arg is None or kw.arg not in names:
            raise OptionError(
                f"augment: {name} has no argument {kw.arg!r}; its arguments: {', '.join(names)}."
            )
        if kw.arg in given:
            raise OptionError(f"augment: {name} got argument {kw.arg!r} twice.")
        given[kw.arg] = _literal(source, name, kw.arg, kw.value)
    args = []
    for key, default in params:
        if key not in given and default is _REQUIRED:
            raise OptionError(f"augment: {name} needs its argument {key!r}, e.g. {_EXAMPLE[name]}.")
        value = given.get(key, default)
        args.append((key, _CHECK[key](name, value)))
    return Op(name, tuple(args))


_EXAMPLE = {
    "RandomResizedCrop": "RandomResizedCrop(224)",
    "Resize": "Resize(256)",
    "CenterCrop": "CenterCrop(224)",
    "RandomCrop": "RandomCrop(32, padding=4)",
    "Normalize": "Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))",
}


def _literal(source: str, op: str, key: str, node: ast.expr) -> Any:
    """A number, bool, None or tuple of them; anything else is refused."""
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (bool, int, float))
    ):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, (int, float))
        and not isinstance(node.operand.value, bool)
    ):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.Tuple, ast.List)) and len(node.elts) <= 4:
        return tuple(_literal(source, op, key, e) for e in node.elts)
    raise OptionError(
        f"augment: {op}'s {key} = {_segment(source, node)} is not a number or a tuple of numbers."
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _size(op: str, v: Any) -> int | tuple[int, int]:
    if isinstance(v, tuple) and len(v) == 1:
        v = v[0]
    if _is_int(v) and 1 <= v <= MAX_SIZE:
        return int(v)
    if isinstance(v, tuple) and len(v) == 2 and all(_is_int(x) and 1 <= x <= MAX_SIZE for x in v):
        return (int(v[0]), int(v[1]))
    raise OptionError(
        f"augment: {op}'s size = {_show(v)} is not a size; use an int or (h, w) of ints from 1 "
        f"to {MAX_SIZE}, e.g. {_EXAMPLE.get(op, 'CenterCrop(224)')}."
    )


def _range(op: str, key: str, v: Any, low: float, high: float) -> tuple[float, float]:
    """(low, high) with ``low`` <= each value <= ``high`` (``low`` excluded when 0)."""
    ok = isinstance(v, tuple) and len(v) == 2 and all(_is_num(x) for x in v)
    if ok and (low < v[0] if low == 0 else low <= v[0]) and v[0] <= v[1] <= high:
        return (float(v[0]), float(v[1]))
    bounds = f"0 < low <= high <= {high:g}" if low == 0 else f"{low:g} <= low <= high <= {high:g}"
    example = dict(OPERATIONS[op])[key]
    raise OptionError(
        f"augment: {op}'s {key} = {_show(v)} is not a range; use (low, high) with "
        f"{bounds}, e.g. {key}={_show(example)}."
    )


def _scale(op: str, v: Any) -> tuple[float, float]:
    return _range(op, "scale", v, 0.0, 1.0)


def _ratio(op: str, v: Any) -> tuple[float, float]:
    return _range(op, "ratio", v, 1 / MAX_RATIO, MAX_RATIO)


def _padding(op: str, v: Any) -> tuple[int, int, int, int] | None:
    """None, or (left, top, right, bottom) as torchvision reads an int, a pair or four."""
    if v is None:
        return None
    items = v if isinstance(v, tuple) else (v,)
    if len(items) in (1, 2, 4) and all(_is_int(x) and 0 <= x <= MAX_SIZE for x in items):
        if len(items) == 1:
            return (items[0],) * 4
        if len(items) == 2:
            return (items[0], items[1], items[0], items[1])
        return (items[0], items[1], items[2], items[3])
    raise OptionError(
        f"augment: {op}'s padding = {_show(v)} is not a padding; use an int, (left/right, "
        f"top/bottom) or (left, top, right, bottom) of ints from 0 to {MAX_SIZE}."
    )


def _flag(op: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise OptionError(f"augment: {op}'s pad_if_needed = {_show(v)} is not True or False.")


def _fill(op: str, v: Any) -> int:
    if _is_int(v) and 0 <= v <= 255:
        return int(v)
    raise OptionError(f"augment: {op}'s fill = {_show(v)} is not a pixel value from 0 to 255.")


def _probability(op: str, v: Any) -> float:
    if _is_num(v) and 0 <= v <= 1:
        return float(v)
    raise OptionError(f"augment: {op}'s p = {_show(v)} is not a probability from 0 to 1.")


def _channels(key: str) -> Callable[[str, Any], tuple[float, float, float]]:
    def check(op: str, v: Any) -> tuple[float, float, float]:
        items = v if isinstance(v, tuple) else (v,)
        if len(items) in (1, 3) and all(_is_num(x) and abs(x) <= _FLOAT32_MAX for x in items):
            if key == "std" and any(x < MIN_STD for x in items):
                raise OptionError(
                    f"augment: {op}'s std = {_show(v)} is below {MIN_STD:g}; a std must be at "
                    f"least {MIN_STD:g} (pixels are 8-bit: a smaller one only scales noise)."
                )
            values = tuple(float(x) for x in items) * (3 if len(items) == 1 else 1)
            return (values[0], values[1], values[2])
        raise OptionError(
            f"augment: {op}'s {key} = {_show(v)} is not one number or three (one per "
            f"channel) that float32 holds, e.g. {_EXAMPLE['Normalize']}."
        )

    return check


_CHECK: dict[str, Callable[[str, Any], object]] = {  # an argument checked, as stored
    "size": _size,
    "scale": _scale,
    "ratio": _ratio,
    "padding": _padding,
    "pad_if_needed": _flag,
    "fill": _fill,
    "p": _probability,
    "mean": _channels("mean"),
    "std": _channels("std"),
}


def default_seed(job: str) -> int:
    """The seed of a job that sets none: stable for its name (jobs differ, reruns agree)."""
    return zlib.crc32(job.encode())


# -- torchvision ---------------------------------------------------------------------------------
_TV_NOOPS = {"ToImage", "ToTensor", "PILToTensor", "ToDtype", "ConvertImageDtype", "ToPureTensor"}


def from_torchvision(compose: Any) -> str:
    """The ``augment`` text of a ``torchvision.transforms(.v2).Compose`` of supported ops.

    Conversions to tensors and dtypes (``ToImage``, ``ToDtype``, ``ToTensor``...) are dropped:
    tabloader's batches are tensors already, and its ``Normalize`` scales by 255 itself.

    Raises:
        OptionError: an op tabloader does not run, named with the supported ones.
    """
    parts = []
    for t in getattr(compose, "transforms", [compose]):
        name = type(t).__name__
        if name in _TV_NOOPS:
            continue
        if name == "RandomResizedCrop":
            parts.append(
                f"RandomResizedCrop({_tv_size(t.size)}, scale={tuple(t.scale)}, "
                f"ratio={tuple(t.ratio)})"
            )
        elif name in ("Resize", "CenterCrop"):
            parts.append(f"{name}({_tv_size(t.size)})")
        elif name == "RandomCrop":
            padding = t.padding if t.padding is None else tuple(_listify(t.padding))
            parts.append(
                f"RandomCrop({_tv_size(t.size)}, padding={padding}, "
                f"pad_if_needed={bool(t.pad_if_needed)}, fill={_tv_fill(t.fill)})"
            )
        elif name == "RandomHorizontalFlip":
            parts.append(f"RandomHorizontalFlip({float(t.p)})")
        elif name == "Normalize":
            parts.append(f"Normalize({tuple(t.mean)}, {tuple(t.std)})")
        else:
            raise OptionError(
                f"augment: torchvision's {name} is not supported; tabloader runs "
                "RandomResizedCrop, Resize, CenterCrop, RandomCrop, RandomHorizontalFlip and "
                "Normalize (and drops ToImage/ToDtype/ToTensor). Apply other transforms in "
                "your training loop."
            )
    return ", ".join(parts)


def _listify(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _tv_size(size: Any) -> str:
    items = _listify(size)
    return str(int(items[0])) if len(items) == 1 else f"({int(items[0])}, {int(items[1])})"


def _tv_fill(fill: Any) -> int:
    if isinstance(fill, dict):  # v2: {type: fill}
        fill = next(iter(fill.values()), 0)
    return int(0 if fill is None else _listify(fill)[0])
