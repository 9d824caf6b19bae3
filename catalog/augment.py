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

``size`` is an int (a square) or ``(h, w)``. Resizes are bilinear with antialiasing (torch's
``interpolate(..., antialias=True)``, as torchvision's v2 on tensors). The output of the
pipeline must have one shape for every image (so that a batch is one array): the last op that
sets the size must be ``RandomResizedCrop``, ``CenterCrop``, ``RandomCrop`` or
``Resize((h, w))``. ``Normalize`` takes the place of torchvision's ``ToDtype(float32,
scale=True)`` + ``Normalize``: it divides by 255 itself.

This module parses and checks (at ``REGISTER``, and for options given at open), writes the
text of a torchvision ``Compose`` (:func:`from_torchvision`) and names a job's default seed;
the draws and the pixels are :mod:`tabloader.engine.augment`'s (a job process that reads
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
import math
import zlib
from dataclasses import dataclass
from typing import Any

from catalog.errors import OptionError

__all__ = [
    "MAX_SIZE",
    "MAX_TEXT",
    "OPERATIONS",
    "AugmentSpec",
    "Op",
    "default_seed",
    "from_torchvision",
    "parse_augment",
]

MAX_TEXT = 2000
"""The longest ``augment`` text (characters): a parse is bounded."""

MAX_SIZE = 1 << 15
"""The largest size (pixels) an operation may ask for."""

_FIX = "e.g. augment = 'RandomResizedCrop(224), RandomHorizontalFlip()'"


@dataclass(frozen=True)
class Op:
    """One operation: its name and its arguments, checked and complete (defaults filled)."""

    name: str
    args: tuple[tuple[str, Any], ...]

    def arg(self, key: str) -> Any:
        return dict(self.args)[key]

    @property
    def size_hw(self) -> tuple[int, int]:
        """The op's ``size`` as ``(h, w)`` (an int is a square)."""
        return _pair(self.arg("size"))

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
        OptionError: not a string, too long, not a list of calls, an unknown operation (with
            the closest known one), a bad or missing argument (named), ``Normalize`` not
            last, or an output size that varies with the image.
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
    try:
        tree = ast.parse(f"[{text}]", mode="eval")
    except SyntaxError as exc:
        raise OptionError(
            f"Job option augment = {text!r} is not a list of operations (column "
            f"{max((exc.offset or 2) - 1, 1)}: {exc.msg}), {_FIX}."
        ) from None
    assert isinstance(tree.body, ast.List)
    ops = tuple(_op(node) for node in tree.body.elts)
    for op in ops[:-1]:
        if op.name == "Normalize":
            raise OptionError(
                "augment: Normalize must be the last operation (it turns the images into "
                "float32 channels-first); move it to the end."
            )
    spec = AugmentSpec(ops)
    spec.output_shape  # noqa: B018 - raises for an output size that varies
    return spec


def _op(node: ast.expr) -> Op:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise OptionError(
            f"augment: {ast.unparse(node)!r} is not an operation call such as "
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
        given[key] = _literal(name, key, arg)
    for kw in node.keywords:
        if kw.arg is None or kw.arg not in names:
            raise OptionError(
                f"augment: {name} has no argument {kw.arg!r}; its arguments: {', '.join(names)}."
            )
        if kw.arg in given:
            raise OptionError(f"augment: {name} got argument {kw.arg!r} twice.")
        given[kw.arg] = _literal(name, kw.arg, kw.value)
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


def _literal(op: str, key: str, node: ast.expr) -> Any:
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
        return tuple(_literal(op, key, e) for e in node.elts)
    raise OptionError(
        f"augment: {op}'s {key} = {ast.unparse(node)} is not a number or a tuple of numbers."
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


def _range(op: str, key: str, v: Any, low: float, high: float | None) -> tuple[float, float]:
    ok = isinstance(v, tuple) and len(v) == 2 and all(_is_num(x) for x in v)
    if ok and low < v[0] <= v[1] and (high is None or v[1] <= high):
        return (float(v[0]), float(v[1]))
    top = "" if high is None else f" and at most {high}"
    example = dict(OPERATIONS[op])[key]
    raise OptionError(
        f"augment: {op}'s {key} = {_show(v)} is not a range; use (low, high) with "
        f"{low} < low <= high{top}, e.g. {key}={_show(example)}."
    )


def _scale(op: str, v: Any) -> tuple[float, float]:
    return _range(op, "scale", v, 0.0, 1.0)


def _ratio(op: str, v: Any) -> tuple[float, float]:
    return _range(op, "ratio", v, 0.0, None)


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


def _channels(key: str) -> Any:
    def check(op: str, v: Any) -> tuple[float, float, float]:
        items = v if isinstance(v, tuple) else (v,)
        if len(items) in (1, 3) and all(_is_num(x) for x in items):
            if key == "std" and any(x <= 0 for x in items):
                raise OptionError(f"augment: {op}'s std = {_show(v)} must be positive.")
            values = tuple(float(x) for x in items) * (3 if len(items) == 1 else 1)
            return (values[0], values[1], values[2])
        raise OptionError(
            f"augment: {op}'s {key} = {_show(v)} is not one number or three (one per "
            f"channel), e.g. {_EXAMPLE['Normalize']}."
        )

    return check


_CHECK: dict[str, Any] = {
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
