"""Each job's own augmentation, on top of the shared decode: draws and pixels.

The shared prefix of loading an image (read + decode, aspect kept, at the smallest DCT scale that
serves the jobs on the column: :class:`tabloader.engine.decode.Fit`) is done once per row for
all jobs and kept in the arena. What stays per job is its random draws and the crop-resize that uses
them, declared with the job (``augment``, parsed by :mod:`tabloader.catalog._augment`):

* **Draws** (:meth:`Augmenter.draw`) are a pure function of (job seed, epoch, row ``_id``) and
  the source shape: a ``numpy`` Philox stream keyed by the three, used in op order with
  torchvision's sampling algorithms (``RandomResizedCrop``'s ten area / log-ratio tries and
  its center-crop fallback, ``RandomCrop``'s uniform offsets, a Bernoulli flip). So a row's
  augmentation does not depend on the order the dependent sampler picked, on other jobs, on
  the service restarting or on a ``state_dict()`` resume: the same seed gives byte-identical
  batches per row, and another epoch or seed other draws.
* **Pixels** (:meth:`Augmenter.apply`): crops and flips are views of the shared (read-only)
  image; each resize is one call of tabloader's kernel (:mod:`tabloader.engine._prepare.resample`:
  torch's antialiased bilinear bytes, GIL released, no torch import) that reads the crop box
  in place, folds the flips that follow it into its horizontal pass and writes the last one
  straight into the job's batch slot (uint8 HWC, or float32 CHW with ``Normalize``), never
  touching the shared value. :meth:`Augmenter.apply_batch` does a batch held in one buffer
  (the arena) with one kernel call. Measured per 224x224 ``RandomResizedCrop`` + flip of a
  500x375 image on one core: 0.29 ms when torch's resize came back channels-first and flips
  were copied by numpy, 0.24 with torch writing channels-last, 0.07 ms with the kernel (0.009
  of it the draws).

Where it runs: in the loader's pool threads when a batch is collated in-process
(:mod:`tabloader.engine._deliver.collate`), in the job process's own threads for the service's
clients (:mod:`tabloader.service._client`): never on the training loop's thread, and the augmented
form is never cached (DS-Analyzer: reusing one augmented image across epochs costs accuracy).

Example:
    >>> import numpy as np
    >>> aug = Augmenter("RandomResizedCrop(8), RandomHorizontalFlip()", seed=1)
    >>> src = np.zeros((12, 16, 3), np.uint8)
    >>> out = np.empty(aug.output_shape, aug.dtype)
    >>> aug.apply(src, epoch=0, row_id=5, out=out)
    >>> out.shape, aug.draw((12, 16), epoch=0, row_id=5) == aug.draw((12, 16), 0, 5)
    ((8, 8, 3), True)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tabloader.catalog._augment import AugmentSpec, Op, parse_augment
from tabloader.catalog._errors import RowReadError
from tabloader.engine._prepare.resample import resize_batch, resize_into
from tabloader.engine.decode import Fit


def shared_fit(spec: AugmentSpec, decode_size: int | None) -> Fit:
    """The shared decode an augmented job reads: shorter side at least what its ops ask for,
    capped at ``decode_size`` (which also lowers the least: a cap under the need wins)."""
    need = spec.need if decode_size is None else min(spec.need, decode_size)
    return Fit(need, decode_size)


class Augmenter:
    """A job's augmentation: ``spec`` (text or parsed) with the job's ``seed``.

    Attributes:
        spec: the parsed ops.
        output_shape: one output image's shape; ``dtype``: uint8, or float32 with Normalize.
    """

    def __init__(self, spec: str | AugmentSpec, seed: int) -> None:
        self.spec = parse_augment(spec) if isinstance(spec, str) else spec
        self.seed = int(seed)
        self.output_shape = self.spec.output_shape
        self.dtype = np.dtype(np.float32 if self.spec.normalized else np.uint8)
        self._ops = self.spec.ops
        self._steps = [(_DRAW[op.name](op), _reshape(op)) for op in self._ops]
        self._streams = RowStreams(self.seed)
        names = tuple(op.name for op in self._ops)
        # the usual recipe, one draw and one kernel call per image (see apply_batch)
        self._one_resize = names in (
            ("RandomResizedCrop",),
            ("RandomResizedCrop", "RandomHorizontalFlip"),
        )
        # an op whose intermediate grows with the source: each source is checked (the other
        # ops' sizes are the spec's own, checked when it was parsed)
        self.grows = any(
            op.name in ("CenterCrop", "RandomCrop")
            or (op.name == "Resize" and not isinstance(op.arg("size"), tuple))
            for op in self._ops
        )
        if self.spec.normalized:
            self._scale, self._offset = normalization(self._ops[-1])

    def draw(self, shape: tuple[int, int], epoch: int, row_id: int) -> list[Any]:
        """The random parameters of every op, in order, for a source of ``shape`` (h, w)."""
        rng = self._streams.generator(epoch, row_id)
        h, w = shape
        out: list[Any] = []
        for draw, reshape in self._steps:
            params = draw(rng, h, w)
            out.append(params)
            h, w = reshape(h, w)
        return out

    def refusal(self, shape: tuple[int, int], row_id: int) -> RowReadError | None:
        """The error of a source of ``shape`` (h, w) whose augmentation would make an image
        over ``tabloader.catalog._augment.MAX_PIXELS`` (a panorama under ``Resize(256)``), else
        None.

        The collate calls it for each row of a batch before augmenting any, so that such a
        row is skipped or raised as the job's ``on_error`` says, as a row that failed to
        decode is.
        """
        if not self.grows:
            return None
        why = self.spec.check_source(shape[0], shape[1])
        if why is None:
            return None
        return RowReadError(
            f"Row {row_id}: augment's {why}, or leave such images out of the job (its WHERE).",
            row_id=row_id,
        )

    def apply(
        self, src: npt.NDArray[np.uint8], epoch: int, row_id: int, out: npt.NDArray[Any]
    ) -> None:
        """Augment ``src`` (uint8 H x W x 3, left untouched) into ``out`` (one batch slot).

        Crops are views; a resize is held back until the next op that is not a flip, so that
        the flips after it are folded into it (written reversed) and the last one writes
        straight into ``out``: the usual recipe is one kernel call and no other copy.

        Raises:
            RowReadError: :meth:`refusal`'s, before anything is allocated.
        """
        if self._one_resize and out.dtype == np.uint8 and out.strides[1:] == (3, 1):
            # the usual recipe, straight to the kernel: 2.5 us less
            params = self.draw(src.shape[:2], epoch, row_id)
            resize_into(src, out, box=params[0], flip=len(params) > 1 and params[1])
            return
        if self.grows:
            error = self.refusal(src.shape[:2], row_id)
            if error is not None:
                raise error
        img = src
        pending: tuple[int, int, bool] | None = None  # a resize of img to (h, w), mirrored?
        for op, params in zip(self._ops, self.draw(src.shape[:2], epoch, row_id), strict=True):
            name = op.name
            if name == "RandomHorizontalFlip":
                if params:
                    if pending is None:
                        img = img[:, ::-1]
                    else:
                        pending = (pending[0], pending[1], not pending[2])
            elif name == "Normalize":
                pass
            else:
                if pending is not None:
                    img = resized(img, pending)
                    pending = None
                if name == "RandomResizedCrop":
                    i, j, ch, cw = params
                    img = img[i : i + ch, j : j + cw]
                    pending = (*op.size_hw, False)
                elif name == "Resize":
                    out_hw = op.output_hw(img.shape[0], img.shape[1])
                    if out_hw != img.shape[:2]:
                        pending = (*out_hw, False)
                else:
                    img = _APPLY[name](op, params, img)
        if self.spec.normalized:
            if pending is not None:
                img = resized(img, pending)
            chw = img.transpose(2, 0, 1)
            np.multiply(chw, self._scale, out=out)
            np.subtract(out, self._offset, out=out)
            return
        if pending is None and img.strides[1] < 0:
            # a mirrored view: the kernel copies it mirrored (8 us for 224x224; numpy copies
            # 3-byte pixels backwards a byte at a time, 180 us)
            img, pending = img[:, ::-1], (img.shape[0], img.shape[1], True)
        if pending is None:
            out[...] = img
        elif out.strides[1:] == (3, 1) and out.flags.writeable:
            resize_into(img, out, flip=pending[2])  # straight into the batch slot
        else:
            out[...] = resized(img, pending)

    def apply_batch(
        self,
        buffer: Any,
        offsets: npt.NDArray[np.integer[Any]],
        shapes: npt.NDArray[np.integer[Any]],
        epoch: int,
        row_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        out: npt.NDArray[Any],
    ) -> None:
        """Augment a batch of images held in one buffer (the arena) into ``out``.

        The same bytes as :meth:`apply` of each image. For the usual recipe
        (``RandomResizedCrop`` [+ ``RandomHorizontalFlip``], uint8) every image's draws come
        first, then one kernel call does the whole batch with the GIL released once; other
        specs go image by image.

        Args:
            buffer: one contiguous byte buffer (e.g. the arena's uint8 array).
            offsets: int64 (n,): where each image (C-contiguous h x w x 3) starts.
            shapes: int64 (n, 2): each image's (h, w).
            epoch: the epoch (the draws depend on it).
            row_ids: (n,): each image's row ``_id``.
            out: (n, *output_shape) of ``dtype``: the batch.

        Raises:
            ValueError: tables of the wrong shape, an image outside ``buffer``.
        """
        starts = np.ascontiguousarray(offsets, np.int64)
        hws = np.ascontiguousarray(shapes, np.int64).reshape(-1, 2)
        ids = [int(r) for r in row_ids]
        n = len(ids)
        if starts.shape != (n,) or hws.shape[0] != n or out.shape[0] != n:
            raise ValueError(
                f"apply_batch: {n} row ids, but offsets {starts.shape}, shapes "
                f"{hws.shape} and out {out.shape}; give one of each per image."
            )
        if self._one_resize and out.dtype == np.uint8:
            boxes = np.empty((n, 4), np.int64)
            flips = np.zeros(n, np.bool_)
            hw = hws.tolist()
            for k in range(n):
                params = self.draw((hw[k][0], hw[k][1]), epoch, ids[k])
                boxes[k] = params[0]
                flips[k] = len(params) > 1 and params[1]
            resize_batch(buffer, starts, hws, boxes, flips, out)
            return
        arena = np.frombuffer(buffer, np.uint8)
        for k, ((h, w), start) in enumerate(zip(hws.tolist(), starts.tolist(), strict=True)):
            if start < 0 or h < 1 or w < 1 or start + h * w * 3 > arena.size:
                raise ValueError(
                    f"image {k}: shape ({h}, {w}) at offset {start} does not fit in the "
                    f"{arena.size}-byte buffer"
                )
            self.apply(arena[start : start + h * w * 3].reshape(h, w, 3), epoch, ids[k], out[k])


def normalization(norm: Op) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """``Normalize``'s (scale, offset), each (3, 1, 1): a uint8 pixel ``x`` becomes
    ``x * scale - offset``, that is ``(x / 255 - mean) / std``."""
    # in float64, then float32: 255 * std overflowed float32 for a std near its largest
    # value (a RuntimeWarning; an error where warnings are), though the scale itself is finite
    std = np.asarray(norm.arg("std"), np.float64)
    scale = (1.0 / (255.0 * std)).astype(np.float32).reshape(3, 1, 1)
    offset = (np.asarray(norm.arg("mean"), np.float64) / std).astype(np.float32).reshape(3, 1, 1)
    return scale, offset


class RowStreams(threading.local):
    """Each thread's Philox generator, repositioned for every (epoch, row): setting its state
    (1.2 us) replaces constructing one per row (8 us). The same stream as
    ``np.random.Generator(np.random.Philox(key=seed, counter=[0, 0, row_id, epoch]))``."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.bits: np.random.Philox | None = None

    def generator(self, epoch: int, row_id: int) -> np.random.Generator:
        """The job's generator at the start of (epoch, row_id)'s stream (the job's key, the
        epoch and row in the counter's high words: a row's draws advance the low words only)."""
        if self.bits is None:
            self.bits = np.random.Philox(key=self.seed)
            self.gen = np.random.Generator(self.bits)
            self.counter = np.zeros(4, np.uint64)
            fresh: Any = self.bits.state
            self.state: Any = {**fresh, "state": {**fresh["state"], "counter": self.counter}}
        self.counter[2] = row_id
        self.counter[3] = epoch
        self.bits.state = self.state
        return self.gen


def resized(img: npt.NDArray[np.uint8], pending: tuple[int, int, bool]) -> npt.NDArray[np.uint8]:
    out_h, out_w, flip = pending
    out = np.empty((out_h, out_w, 3), np.uint8)
    resize_into(img, out, flip=flip)
    return out


# -- draws (torchvision's algorithms, on the job's own generator) -------------------------------
# Each op's draw is compiled once per job from its arguments: draw(rng, h, w) -> params.
Draw = Callable[[np.random.Generator, int, int], Any]


def _draw_rrc(op: Op) -> Draw:
    """``RandomResizedCrop.get_params``: (top, left, height, width)."""
    lo, hi = op.arg("scale")
    ratio = op.arg("ratio")
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    r_min, r_max = min(ratio), max(ratio)

    def draw(rng: np.random.Generator, h: int, w: int) -> tuple[int, int, int, int]:
        area = h * w
        for _ in range(10):
            target_area = area * rng.uniform(lo, hi)
            aspect = math.exp(rng.uniform(log_lo, log_hi))
            cw = round(math.sqrt(target_area * aspect))
            ch = round(math.sqrt(target_area / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                i = int(rng.integers(0, h - ch + 1))
                j = int(rng.integers(0, w - cw + 1))
                return i, j, ch, cw
        in_ratio = w / h  # fallback: a center crop of the ratio's nearest bound
        if in_ratio < r_min:  # at least one pixel (torchvision rounds a thin one to 0)
            cw, ch = w, min(max(round(w / r_min), 1), h)
        elif in_ratio > r_max:
            ch, cw = h, min(max(round(h * r_max), 1), w)
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    return draw


def _draw_crop(op: Op) -> Draw:
    """``RandomCrop.get_params`` after its padding: (top, left) in the padded image."""
    th, tw = op.size_hw

    def draw(rng: np.random.Generator, h: int, w: int) -> tuple[int, int]:
        left, top, right, bottom = op.padding_for(h, w)
        ph, pw = h + top + bottom, w + left + right
        return int(rng.integers(0, ph - th + 1)), int(rng.integers(0, pw - tw + 1))

    return draw


def _draw_flip(op: Op) -> Draw:
    p = op.arg("p")
    return lambda rng, h, w: bool(rng.random() < p)


def _no_draw(op: Op) -> Draw:
    return lambda rng, h, w: None


_DRAW: dict[str, Callable[[Op], Draw]] = {
    "RandomResizedCrop": _draw_rrc,
    "Resize": _no_draw,
    "CenterCrop": _no_draw,
    "RandomCrop": _draw_crop,
    "RandomHorizontalFlip": _draw_flip,
    "Normalize": _no_draw,
}


# -- shapes (the ops' own: ``Op.output_hw``, ``Op.padding_for``) and pixels ----------------------
def _reshape(op: Op) -> Callable[[int, int], tuple[int, int]]:
    """``op.output_hw``, a fixed size looked up once (it runs for every image)."""
    if op.name in ("RandomHorizontalFlip", "Normalize"):
        return lambda h, w: (h, w)
    if op.name == "Resize" and not isinstance(op.arg("size"), tuple):
        return op.output_hw
    hw = op.size_hw
    return lambda h, w: hw


def _apply_center(op: Op, params: Any, img: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    th, tw = op.size_hw
    pad = op.padding_for(img.shape[0], img.shape[1])
    if any(pad):  # torchvision pads with zeros first, split evenly (more after)
        img = padded(img, pad, 0)
    h, w = img.shape[:2]
    top, left = round((h - th) / 2.0), round((w - tw) / 2.0)
    return img[top : top + th, left : left + tw]


def _apply_crop(op: Op, params: Any, img: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    pad = op.padding_for(img.shape[0], img.shape[1])
    if any(pad):
        img = padded(img, pad, op.arg("fill"))
    i, j = params
    th, tw = op.size_hw
    return img[i : i + th, j : j + tw]


def padded(
    img: npt.NDArray[np.uint8], pad: tuple[int, int, int, int], fill: int
) -> npt.NDArray[np.uint8]:
    left, top, right, bottom = pad
    h, w = img.shape[:2]
    out = np.full((h + top + bottom, w + left + right, 3), fill, np.uint8)
    out[top : top + h, left : left + w] = img
    return out


_Apply = Callable[[Op, Any, npt.NDArray[np.uint8]], npt.NDArray[np.uint8]]
_APPLY: dict[str, _Apply] = {  # the ops that are views or copies (the resizes are apply's own)
    "CenterCrop": _apply_center,
    "RandomCrop": _apply_crop,
}
