"""Each job's own augmentation, on top of the shared decode: draws and pixels.

The shared prefix of loading an image (read + decode, aspect kept, at the smallest DCT scale
that serves the jobs on the column: :class:`tabloader.engine.prep.Fit`) is done once per row for all
jobs and kept in the arena. What stays per job is its random draws and the crop-resize that
uses them, declared with the job (``augment``, parsed by :mod:`catalog.augment`):

* **Draws** (:meth:`Augmenter.draw`) are a pure function of (job seed, epoch, row ``_id``) and
  the source shape: a ``numpy`` Philox stream keyed by the three, used in op order with
  torchvision's sampling algorithms (``RandomResizedCrop``'s ten area / log-ratio tries and
  its center-crop fallback, ``RandomCrop``'s uniform offsets, a Bernoulli flip). So a row's
  augmentation does not depend on the order the dependent sampler picked, on other jobs, on
  the service restarting or on a ``state_dict()`` resume: the same seed gives byte-identical
  batches per row, and another epoch or seed other draws.
* **Pixels** (:meth:`Augmenter.apply`): crops and flips are views of the shared (read-only)
  image; each resize is one bilinear antialiased interpolation (torch, GIL released,
  channels-last in and out: :func:`tabloader.engine.prep.resize_hw`); the last step writes
  into the job's batch slot (uint8 HWC, or float32 CHW with ``Normalize``), never touching
  the shared value. Measured per 224x224 ``RandomResizedCrop`` + flip of a 500x375 image on
  one thread: 0.29 ms when the resize came back channels-first and flips were copied by
  numpy, 0.14 ms now.

Where it runs: in the loader's pool threads when a batch is collated in-process
(:mod:`tabloader.engine.collate`), in the job process's own threads for the service's clients
(:mod:`tabloader.service.client`): never on the training loop's thread, and the augmented
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
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

from catalog.augment import AugmentSpec, Op, parse_augment
from catalog.errors import OptionError
from tabloader.engine.prep import Fit, resize_hw

__all__ = ["Augmenter", "default_seed", "from_torchvision", "shared_fit"]


def default_seed(job: str) -> int:
    """The seed of a job that sets none: stable for its name (jobs differ, reruns agree)."""
    return zlib.crc32(job.encode())


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
        norm = self._ops[-1] if self.spec.normalized else None
        if norm is not None:
            std = np.asarray(norm.arg("std"), np.float32)
            self._scale = (1.0 / (255.0 * std)).reshape(3, 1, 1)
            self._offset = (np.asarray(norm.arg("mean"), np.float32) / std).reshape(3, 1, 1)

    def draw(self, shape: tuple[int, int], epoch: int, row_id: int) -> list[Any]:
        """The random parameters of every op, in order, for a source of ``shape`` (h, w)."""
        # the job's key, the (epoch, row) in the counter's high words: one disjoint stream per
        # row and epoch (a row's draws advance the low words only)
        rng = np.random.Generator(np.random.Philox(key=self.seed, counter=[0, 0, row_id, epoch]))
        h, w = shape
        out: list[Any] = []
        for op in self._ops:
            params = _DRAW[op.name](op, rng, h, w)
            out.append(params)
            h, w = _SHAPE[op.name](op, params, h, w)
        return out

    def apply(
        self, src: npt.NDArray[np.uint8], epoch: int, row_id: int, out: npt.NDArray[Any]
    ) -> None:
        """Augment ``src`` (uint8 H x W x 3, left untouched) into ``out`` (one batch slot)."""
        img = src
        for op, params in zip(self._ops, self.draw(src.shape[:2], epoch, row_id), strict=True):
            if op.name == "RandomHorizontalFlip":
                if params:
                    img = img[:, ::-1]
            elif op.name != "Normalize":
                img = _APPLY[op.name](op, params, img)
        if self.spec.normalized:
            chw = img.transpose(2, 0, 1)
            np.multiply(chw, self._scale, out=out)
            np.subtract(out, self._offset, out=out)
        elif img.strides[1] < 0 and img.strides[2] == 1 and out.strides[2] == 1:
            # flipped: numpy copies 3-byte pixels backwards a byte at a time (0.18 ms for
            # 224x224), as one 3-byte item each in 0.06 ms (torch.flip's 0.01 would wake
            # OpenMP threads that then spin, doubling the CPU time in the loader's threads)
            _pixels(out)[...] = _pixels(img[:, ::-1])[:, ::-1]
        else:
            out[...] = img


_PIXEL = np.dtype((np.void, 3))


def _pixels(img: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """An H x W x 3 uint8 image (channels contiguous) as H x W items of 3 bytes."""
    return img.view(_PIXEL)[..., 0]


# -- draws (torchvision's algorithms, on the job's own generator) -------------------------------
def _draw_rrc(op: Op, rng: np.random.Generator, h: int, w: int) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params``: (top, left, height, width)."""
    area = h * w
    lo, hi = op.arg("scale")
    log_ratio = (math.log(op.arg("ratio")[0]), math.log(op.arg("ratio")[1]))
    for _ in range(10):
        target_area = area * rng.uniform(lo, hi)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw = round(math.sqrt(target_area * aspect))
        ch = round(math.sqrt(target_area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            i = int(rng.integers(0, h - ch + 1))
            j = int(rng.integers(0, w - cw + 1))
            return i, j, ch, cw
    in_ratio = w / h  # fallback: a center crop of the ratio's nearest bound
    if in_ratio < min(op.arg("ratio")):
        cw, ch = w, round(w / min(op.arg("ratio")))
    elif in_ratio > max(op.arg("ratio")):
        ch, cw = h, round(h * max(op.arg("ratio")))
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def _draw_crop(op: Op, rng: np.random.Generator, h: int, w: int) -> tuple[int, int]:
    """``RandomCrop.get_params`` after its padding: (top, left) in the padded image."""
    th, tw = op.size_hw
    ph, pw = _padded(op, h, w)
    return int(rng.integers(0, ph - th + 1)), int(rng.integers(0, pw - tw + 1))


def _padded(op: Op, h: int, w: int) -> tuple[int, int]:
    left, top, right, bottom = _crop_padding(op, h, w)
    return h + top + bottom, w + left + right


def _crop_padding(op: Op, h: int, w: int) -> tuple[int, int, int, int]:
    left, top, right, bottom = op.arg("padding") or (0, 0, 0, 0)
    th, tw = op.size_hw
    if op.arg("pad_if_needed"):
        ph, pw = h + top + bottom, w + left + right
        if pw < tw:
            left, right = left + tw - pw, right + tw - pw
        if ph < th:
            top, bottom = top + th - ph, bottom + th - ph
    return left, top, right, bottom


def _no_draw(op: Op, rng: np.random.Generator, h: int, w: int) -> None:
    return None


_DRAW: dict[str, Any] = {
    "RandomResizedCrop": _draw_rrc,
    "Resize": _no_draw,
    "CenterCrop": _no_draw,
    "RandomCrop": _draw_crop,
    "RandomHorizontalFlip": lambda op, rng, h, w: bool(rng.random() < op.arg("p")),
    "Normalize": _no_draw,
}


# -- shapes and pixels -------------------------------------------------------------------------
def _resize_to(op: Op, h: int, w: int) -> tuple[int, int]:
    """``Resize``'s output: an int scales the shorter side (the longer truncated, as
    torchvision computes it), a pair is exact."""
    size = op.arg("size")
    if isinstance(size, tuple):
        return size
    if h <= w:
        return size, int(size * w / h)
    return int(size * h / w), size


_SHAPE: dict[str, Any] = {
    "RandomResizedCrop": lambda op, p, h, w: op.size_hw,
    "Resize": lambda op, p, h, w: _resize_to(op, h, w),
    "CenterCrop": lambda op, p, h, w: op.size_hw,
    "RandomCrop": lambda op, p, h, w: op.size_hw,
    "RandomHorizontalFlip": lambda op, p, h, w: (h, w),
    "Normalize": lambda op, p, h, w: (h, w),
}


def _apply_rrc(op: Op, params: Any, img: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    i, j, ch, cw = params
    return resize_hw(img[i : i + ch, j : j + cw], *op.size_hw)


def _apply_resize(op: Op, params: Any, img: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    out_h, out_w = _resize_to(op, img.shape[0], img.shape[1])
    if (out_h, out_w) == img.shape[:2]:
        return img
    return resize_hw(img, out_h, out_w)


def _apply_center(op: Op, params: Any, img: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    th, tw = op.size_hw
    h, w = img.shape[:2]
    if th > h or tw > w:  # torchvision pads with zeros first, split evenly (more after)
        top, left = max(th - h, 0) // 2, max(tw - w, 0) // 2
        img = _pad(img, (left, top, max(tw - w, 0) - left, max(th - h, 0) - top), 0)
        h, w = img.shape[:2]
    top, left = round((h - th) / 2.0), round((w - tw) / 2.0)
    return img[top : top + th, left : left + tw]


def _apply_crop(op: Op, params: Any, img: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    pad = _crop_padding(op, img.shape[0], img.shape[1])
    if any(pad):
        img = _pad(img, pad, op.arg("fill"))
    i, j = params
    th, tw = op.size_hw
    return img[i : i + th, j : j + tw]


def _pad(
    img: npt.NDArray[np.uint8], pad: tuple[int, int, int, int], fill: int
) -> npt.NDArray[np.uint8]:
    left, top, right, bottom = pad
    h, w = img.shape[:2]
    out = np.full((h + top + bottom, w + left + right, 3), fill, np.uint8)
    out[top : top + h, left : left + w] = img
    return out


_APPLY: dict[str, Any] = {
    "RandomResizedCrop": _apply_rrc,
    "Resize": _apply_resize,
    "CenterCrop": _apply_center,
    "RandomCrop": _apply_crop,
}


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
