"""The crop-resize-flip kernel: torch's bytes (and an independent reference of the same
arithmetic), AVX2 == portable C, batch == one by one, no read past the source, clear errors,
and the torch / Pillow fallbacks where the extension is missing."""

from __future__ import annotations

import ctypes
import math
import mmap
import subprocess
import sys

import numpy as np
import pytest
import torch

from tabloader.engine._prepare import resample
from tabloader.engine._prepare.resample import Resampler, resize_batch, resize_hw, resize_into

kernel = pytest.importorskip("tabloader.engine._prepare._resample")

# torch's portable (non-AVX) uint8 path, like its float path, gives every row of a 1-pixel-wide
# output the first row's value; its AVX2 / AVX-512 paths and the reference below do not.
TORCH_WIDTH1_OK = torch.backends.cpu.get_cpu_capability() != "DEFAULT"


@pytest.fixture(params=["avx2", "scalar"])
def isa(request):
    """Each code path (where the CPU has no AVX2, both are the portable one)."""
    old = kernel.set_isa(request.param)
    yield kernel.isa()
    kernel.set_isa(old)


def torch_resize(src, box, out_hw, flip):
    top, left, h, w = box
    crop = torch.from_numpy(np.ascontiguousarray(src[top : top + h, left : left + w]))
    res = torch.nn.functional.interpolate(
        crop.permute(2, 0, 1)[None], out_hw, mode="bilinear", antialias=True
    )[0].permute(1, 2, 0)
    res = res.numpy()
    return res[:, ::-1] if flip else res


def weights(n_in, n_out):
    """aten's int16 antialiased bilinear weights, written out in Python floats (doubles)."""
    scale = n_in / n_out
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    maxk = math.ceil(support) * 2 + 1
    rows, wmax = [], 0.0
    for i in range(n_out):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), n_in) - xmin, 0), maxk)
        ws = []
        for j in range(xsize):
            x = abs((j + xmin - center + 0.5) * invscale)
            ws.append(1.0 - x if x < 1.0 else 0.0)
        total = 0.0
        for v in ws:
            total += v
        if total != 0.0:
            ws = [v / total for v in ws]
            wmax = max([wmax, *ws])
        rows.append((xmin, ws))
    prec = 0
    while prec < 22 and int(0.5 + wmax * (1 << (prec + 1))) < (1 << 15):
        prec += 1
    return [(xmin, [int(0.5 + v * (1 << prec)) for v in ws]) for xmin, ws in rows], prec


def one_pass(img, axis, n_out):
    table, prec = weights(img.shape[axis], n_out)
    img = np.moveaxis(img, axis, 0)
    out = np.empty((n_out, *img.shape[1:]), np.int64)
    for i, (xmin, ws) in enumerate(table):
        acc = np.full(img.shape[1:], 1 << (prec - 1), np.int64)
        for j, w in enumerate(ws):
            acc += w * img[xmin + j]
        out[i] = np.clip(acc >> prec, 0, 255)
    return np.moveaxis(out, 0, axis)


def reference(src, box, out_hw, flip):
    """The arithmetic the kernel implements: horizontal pass first, rounded to uint8, then
    vertical; an axis whose size does not change is left alone."""
    top, left, h, w = box
    img = src[top : top + h, left : left + w].astype(np.int64)
    if w != out_hw[1]:
        img = one_pass(img, 1, out_hw[1])
    if h != out_hw[0]:
        img = one_pass(img, 0, out_hw[0])
    res = img.astype(np.uint8)
    return res[:, ::-1] if flip else res


def random_case(rng, kind):
    """(src, box, (out_h, out_w), flip): sizes that enlarge, shrink, keep an axis, have 1-pixel
    sides or extreme aspect ratios, boxes anywhere (often touching the borders)."""
    h, w = (int(v) for v in rng.integers(1, 200, 2))
    if kind == "thin":
        h, w = (int(rng.integers(1, 4)), int(rng.integers(1, 600)))[:: int(rng.choice([1, -1]))]
    src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    if rng.random() < 0.3:  # flat areas and hard edges, not only noise
        src = np.ascontiguousarray(np.repeat(np.repeat(src[::6, ::6], 6, 0), 6, 1)[:h, :w])
    ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
    top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    edge = rng.integers(0, 4)
    top = h - ch if edge == 1 else 0 if edge == 2 else top
    left = w - cw if edge in (1, 3) else left
    oh, ow = (int(v) for v in rng.integers(1, 260, 2))
    if kind == "keep-h":
        oh = ch
    elif kind == "keep-w":
        ow = cw
    elif kind == "extreme":
        oh, ow = (int(rng.integers(1, 4)), int(rng.integers(150, 400)))[:: int(rng.choice([1, -1]))]
    return src, (top, left, ch, cw), (oh, ow), bool(rng.random() < 0.5)


KINDS = ["any", "thin", "keep-h", "keep-w", "extreme"]


def run(src, box, out_hw, flip):
    out = np.empty((*out_hw, 3), np.uint8)
    resize_into(src, out, box=box, flip=flip)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_equals_torchs_interpolate_bytes(kind, isa):
    rng = np.random.default_rng(KINDS.index(kind))
    cases = 0
    for _ in range(60):
        src, box, out_hw, flip = random_case(rng, kind)
        if out_hw[1] == 1 and not TORCH_WIDTH1_OK:
            continue
        np.testing.assert_array_equal(
            run(src, box, out_hw, flip), torch_resize(src, box, out_hw, flip)
        )
        cases += 1
    assert cases >= 40


@pytest.mark.parametrize("kind", KINDS)
def test_equals_the_reference_arithmetic(kind, isa):
    rng = np.random.default_rng(10 + KINDS.index(kind))
    for _ in range(25):
        src, box, out_hw, flip = random_case(rng, kind)
        np.testing.assert_array_equal(
            run(src, box, out_hw, flip), reference(src, box, out_hw, flip)
        )


def test_usual_crops_of_a_decode_equal_torch():
    """The job's case: RandomResizedCrop(224)-like boxes of a 375x500 image, both paths."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (375, 500, 3), dtype=np.uint8)
    for k in range(40):
        h, w = int(rng.integers(30, 376)), int(rng.integers(30, 501))
        box = (int(rng.integers(0, 376 - h)), int(rng.integers(0, 501 - w)), h, w)
        want = torch_resize(src, box, (224, 224), k % 2 == 1)
        for path in ("avx2", "scalar"):
            kernel.set_isa(path)
            try:
                np.testing.assert_array_equal(run(src, box, (224, 224), k % 2 == 1), want)
            finally:
                kernel.set_isa("auto")


@pytest.mark.parametrize(
    ("src_hw", "out_hw"),
    [
        ((1200, 1800), (224, 224)),  # 8x shrink: 17-tap windows
        ((3000, 40), (7, 33)),  # 430x: windows wider than the AVX2 vertical pass takes
        ((10, 10), (500, 700)),  # 70x enlargement
        ((1, 3000), (1, 17)),
        ((3000, 2), (3, 2)),
    ],
)
def test_extreme_scales_equal_torch(src_hw, out_hw, isa):
    src = np.random.default_rng(sum(src_hw)).integers(0, 256, (*src_hw, 3), dtype=np.uint8)
    box = (0, 0, *src_hw)
    want = torch_resize(src, box, out_hw, True)
    np.testing.assert_array_equal(run(src, box, out_hw, True), want)


def test_avx2_and_portable_paths_give_the_same_bytes():
    rng = np.random.default_rng(11)
    for i in range(150):
        src, box, out_hw, flip = random_case(rng, KINDS[i % len(KINDS)])
        got = {}
        for path in ("avx2", "scalar"):
            kernel.set_isa(path)
            try:
                got[path] = run(src, box, out_hw, flip)
            finally:
                kernel.set_isa("auto")
        np.testing.assert_array_equal(got["avx2"], got["scalar"])


def test_same_size_is_a_copy_and_flip_a_mirror(isa):
    src = np.random.default_rng(2).integers(0, 256, (9, 17, 3), dtype=np.uint8)
    np.testing.assert_array_equal(run(src, (1, 2, 7, 13), (7, 13), False), src[1:8, 2:15])
    np.testing.assert_array_equal(run(src, (1, 2, 7, 13), (7, 13), True), src[1:8, 2:15][:, ::-1])
    np.testing.assert_array_equal(run(src, (0, 0, 9, 17), (9, 17), True), src[:, ::-1])


def test_strided_source_rows_and_output_slots(isa):
    """A crop of a wider array (rows with a stride) into a slot of a wider output."""
    rng = np.random.default_rng(3)
    big = rng.integers(0, 256, (50, 80, 3), dtype=np.uint8)
    src = big[5:45, 10:70]
    wide = np.zeros((30, 40, 3), np.uint8)
    resize_into(src, wide[2:22, 5:35], box=(3, 4, 30, 50), flip=True)
    np.testing.assert_array_equal(wide[2:22, 5:35], reference(src, (3, 4, 30, 50), (20, 30), True))
    wide[2:22, 5:35] = 0
    assert not wide.any()  # nothing written outside the slot


def test_other_layouts_are_copied_first():
    src = np.random.default_rng(4).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    for view in (src[:, ::-1], src[::-1], np.asfortranarray(src)):
        out = np.empty((10, 12, 3), np.uint8)
        resize_into(view, out)
        np.testing.assert_array_equal(
            out, reference(np.ascontiguousarray(view), (0, 0, 20, 30), (10, 12), False)
        )


def guarded(nbytes):
    """A writable uint8 array of nbytes that ends right before an unreadable page."""
    page = mmap.PAGESIZE
    pages = -(-nbytes // page)
    mem = mmap.mmap(-1, (pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + pages * page, page, 0) == 0  # PROT_NONE
    arr = np.frombuffer(mem, np.uint8, count=pages * page)
    return mem, arr[pages * page - nbytes :]


@pytest.mark.parametrize(("h", "w"), [(37, 53), (5, 1), (1, 7), (64, 224)])
def test_never_reads_past_the_sources_last_byte(h, w, isa):
    """Boxes touching the bottom-right corner of an image whose last byte is followed by a
    page that faults: the 16-byte loads of 3-byte pixels must not reach it."""
    mem, tail = guarded(h * w * 3)
    src = tail.reshape(h, w, 3)
    src[...] = np.random.default_rng(h * w).integers(0, 256, src.shape, dtype=np.uint8)
    for box in [
        (0, 0, h, w),
        (h - 1, w - 1, 1, 1),
        (max(h - 3, 0), max(w - 4, 0), min(h, 3), min(w, 4)),
    ]:
        for out_hw in [(box[2], 7), (5, box[3]), (1, 1), (31, 45), (box[2], box[3])]:
            for flip in (False, True):
                np.testing.assert_array_equal(
                    run(src, box, out_hw, flip), reference(src, box, out_hw, flip)
                )
    arena = tail  # the batch entry point, the image last in its buffer
    out = np.empty((1, 9, 11, 3), np.uint8)
    resize_batch(
        arena, np.array([0]), np.array([[h, w]]), np.array([[0, 0, h, w]]), np.array([True]), out
    )
    np.testing.assert_array_equal(out[0], reference(src, (0, 0, h, w), (9, 11), True))
    del src, arena, tail
    mem.close()


def test_batch_equals_one_by_one(isa):
    rng = np.random.default_rng(6)
    images = [
        rng.integers(0, 256, (int(h), int(w), 3), dtype=np.uint8)
        for h, w in rng.integers(1, 120, (12, 2))
    ]
    arena = np.concatenate([np.zeros(7, np.uint8)] + [im.ravel() for im in images])
    offsets = 7 + np.cumsum([0] + [im.size for im in images[:-1]])
    shapes = np.array([im.shape[:2] for im in images])
    boxes = []
    for h, w in shapes:
        ch, cw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        boxes.append((int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw))
    boxes = np.array(boxes)
    flips = rng.random(12) < 0.5
    out = np.empty((12, 33, 40, 3), np.uint8)
    resize_batch(arena, offsets, shapes, boxes, flips, out)
    for k, im in enumerate(images):
        np.testing.assert_array_equal(out[k], run(im, tuple(boxes[k]), (33, 40), bool(flips[k])))
    resize_batch(arena, offsets[:0], shapes[:0], boxes[:0], flips[:0], out[:0])  # empty: fine


def test_threads_resize_at_once_with_their_own_scratch(isa):
    """The GIL is released and each thread has its own scratch memory: resizes of different
    sizes in 4 threads at once give the bytes of the same resizes one after another."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(12)
    cases = [random_case(rng, KINDS[i % len(KINDS)]) for i in range(120)]
    want = [run(*case) for case in cases]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda case: run(*case), cases))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_resize_hw_returns_a_new_contiguous_array():
    src = np.random.default_rng(7).integers(0, 256, (20, 30, 3), dtype=np.uint8)[:, 5:]
    out = resize_hw(src, 11, 9)
    assert out.flags.c_contiguous
    assert out.shape == (11, 9, 3)
    same = resize_hw(src, 20, 25)
    assert same.flags.c_contiguous
    assert not np.shares_memory(same, src)
    np.testing.assert_array_equal(same, src)


# ------------------------------------------------------------------------------ bad inputs
SRC = np.zeros((10, 12, 3), np.uint8)


@pytest.mark.parametrize(
    ("src", "out", "box", "match"),
    [
        (SRC.astype(np.float32), np.empty((4, 4, 3), np.uint8), None, r"src must be a uint8 array"),
        (
            np.zeros((10, 12, 4), np.uint8),
            np.empty((4, 4, 3), np.uint8),
            None,
            r"src must have shape \(height, width, 3\); got \(10, 12, 4\)",
        ),
        (
            np.zeros((10, 12), np.uint8),
            np.empty((4, 4, 3), np.uint8),
            (0, 0, 1, 1),
            r"src must have shape",
        ),
        (SRC, np.empty((4, 4, 3), np.int16), None, r"out must be a uint8 array"),
        (
            SRC,
            np.empty((4, 4), np.uint8),
            None,
            r"out must have shape \(height, width, 3\); got \(4, 4\)",
        ),
        (SRC, np.empty((0, 4, 3), np.uint8), None, r"out is empty"),
        (
            SRC,
            np.empty((4, 12, 3), np.uint8)[:, ::2],
            None,
            r"out must hold pixels as 3 contiguous bytes",
        ),
        (
            SRC,
            np.empty((4, 4, 3), np.uint8),
            (0, 0, 11, 12),
            r"box \(top, left, height, width\) = \(0, 0, 11, 12\) is not a non-empty box "
            r"inside the 10 x 12 source",
        ),
        (SRC, np.empty((4, 4, 3), np.uint8), (-1, 0, 2, 2), r"is not a non-empty box"),
        (SRC, np.empty((4, 4, 3), np.uint8), (0, 5, 3, 8), r"is not a non-empty box"),
        (SRC, np.empty((4, 4, 3), np.uint8), (2, 2, 0, 3), r"is not a non-empty box"),
    ],
)
def test_bad_inputs_raise_value_errors(src, out, box, match, resizer):
    if resizer != "kernel" and match.startswith("out must hold pixels"):
        resize_into(src, out, box=box)  # the fallbacks write any numpy layout
        return
    with pytest.raises(ValueError, match=match):
        resize_into(src, out, box=box)


def test_read_only_out_is_refused(resizer):
    out = np.empty((4, 4, 3), np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writable uint8 array"):
        resize_into(SRC, out)


def test_bad_batch_tables_name_the_table_or_image():
    arena = np.zeros(10 * 12 * 3 * 2, np.uint8)
    offs, shapes = np.array([0, 360]), np.array([[10, 12], [10, 12]])
    boxes, flips = np.array([[0, 0, 10, 12], [0, 0, 10, 12]]), np.array([False, True])
    out = np.empty((2, 4, 4, 3), np.uint8)
    resize_batch(arena, offs.astype(np.int32), shapes.tolist(), boxes, flips.tolist(), out)
    raw = kernel.resize_batch  # the wrapper converts tables; the kernel checks them
    with pytest.raises(ValueError, match=r"offsets must be an int64 array of shape \(2,\); got"):
        raw(arena, offs.astype(np.int32), shapes, boxes, flips, out)
    with pytest.raises(ValueError, match=r"offsets must be a C-contiguous int64 array"):
        raw(arena, np.array([0, 9, 360])[::2], shapes, boxes, flips, out)
    with pytest.raises(ValueError, match=r"shapes must be an int64 array of shape \(2, 2\)"):
        raw(arena, offs, shapes[:1], boxes, flips, out)
    with pytest.raises(ValueError, match=r"boxes must be an int64 array of shape \(2, 4\)"):
        raw(arena, offs, shapes, np.ascontiguousarray(boxes[:, :3]), flips, out)
    with pytest.raises(ValueError, match=r"flips must be a bool array of shape \(2,\)"):
        raw(arena, offs, shapes, boxes, flips[:1], out)
    with pytest.raises(TypeError, match="takes 6 arguments"):
        raw(arena, offs, shapes, boxes, flips)
    with pytest.raises(ValueError, match="arena must be a contiguous byte buffer"):
        raw(np.zeros((4, 4))[:, ::2], offs, shapes, boxes, flips, out)
    with pytest.raises(ValueError, match="unknown resample path 'sse'"):
        kernel.set_isa("sse")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"offsets": [0, 361]}, r"image 1: shape \(10, 12\) at offset 361 does not fit in the "),
        ({"offsets": [-1, 0]}, r"image 0: shape \(10, 12\) at offset -1 does not fit"),
        ({"shapes": [[10, 12], [0, 12]]}, r"image 1: shape \(0, 12\) at offset 360"),
        ({"boxes": [[0, 0, 10, 13], [0, 0, 1, 1]]}, r"image 0: box .* = \(0, 0, 10, 13\) is not"),
        ({"boxes": [[0, 0, 1, 1], [10, 0, 1, 1]]}, r"image 1: box .* = \(10, 0, 1, 1\) is not"),
        ({"out": np.empty((4, 4, 3), np.uint8)}, r"out must have shape \(n, height, width, 3\)"),
        ({"out": np.empty((3, 4, 4, 3), np.uint8)}, r"must have shapes|must be an int64 array"),
    ],
)
def test_bad_batches_raise_value_errors(change, match, resizer):
    args = {
        "buffer": np.zeros(10 * 12 * 3 * 2, np.uint8),
        "offsets": [0, 360],
        "shapes": [[10, 12], [10, 12]],
        "boxes": [[0, 0, 10, 12], [0, 0, 10, 12]],
        "flips": [False, True],
        "out": np.empty((2, 4, 4, 3), np.uint8),
    }
    args.update(change)
    with pytest.raises(ValueError, match=match):
        resize_batch(**args)


# ------------------------------------------------------------------------------ fallbacks
def test_without_the_kernel_torch_gives_the_same_bytes_and_pillow_nearly(resizer, caplog):
    rng = np.random.default_rng(8)
    src = rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)
    src.flags.writeable = False  # like the arena's values
    for box, out_hw, flip in [((5, 7, 40, 50), (24, 32), True), ((0, 0, 60, 80), (90, 70), False)]:
        got = run(src, box, out_hw, flip)
        want = reference(src, box, out_hw, flip)
        if resizer == "pillow":  # Pillow's own rounding: give or take 1
            assert np.abs(got.astype(int) - want).max() <= 1
        else:
            np.testing.assert_array_equal(got, want)
    assert resample.resampler() is Resampler(resizer)
    if resizer != "kernel":
        assert resizer in caplog.text.lower()  # said which resizer runs
    out = np.empty((2, 24, 32, 3), np.uint8)
    arena = np.ascontiguousarray(src).ravel()
    resize_batch(
        arena,
        np.array([0, 0]),
        np.array([[60, 80]] * 2),
        np.array([[5, 7, 40, 50]] * 2),
        np.array([True, False]),
        out,
    )
    np.testing.assert_array_equal(out[1], out[0][:, ::-1])


def test_env_var_forces_the_portable_path_and_nothing_imports_torch():
    code = (
        "import sys, numpy as np\n"
        "from tabloader.engine._prepare import _resample, augment, decoding\n"
        "from tabloader.engine.decode import _images as codec\n"
        "import tabloader.service._server\n"
        "aug = augment.Augmenter('RandomResizedCrop(8), RandomHorizontalFlip()', 1)\n"
        "out = np.empty(aug.output_shape, np.uint8)\n"
        "aug.apply(np.zeros((20, 30, 3), np.uint8), 0, 1, out)\n"
        "codec._resize(np.zeros((20, 30, 3), np.uint8), 10)\n"
        "print(_resample.isa(), 'torch' in sys.modules, decoding.FORKSERVER_PRELOAD)\n"
    )
    env = {"TABLOADER_RESAMPLE": "scalar", "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["scalar", "False", "('tabloader.engine._prepare.decoding',)"]
