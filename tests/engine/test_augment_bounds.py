"""What an augmentation may allocate: whatever a spec's check accepts runs within its stated
bound (``tabloader.catalog._augment.MAX_PIXELS`` per intermediate), a source of another shape is
refused per image before anything is allocated, the crop fallback is never empty, and every entry
point refuses a bad text with the same ``OptionError``."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_augment import torchvision_rrc

from tabloader.catalog import _augment as spec_module
from tabloader.catalog._augment import parse_augment
from tabloader.catalog._errors import OptionError, RowReadError
from tabloader.engine import Loader
from tabloader.engine._deliver.collate import release
from tabloader.engine._prepare import augment as engine
from tabloader.engine._prepare.augment import Augmenter
from tabloader.torch import JobDataset

PROPERTY = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# -- the crop fallback ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hw", "ratio"),
    [((1, 50), (0.2, 0.3)), ((50, 1), (3.0, 4.0)), ((1, 1000), (0.01, 0.4))],
)
def test_the_fallback_crop_is_at_least_one_pixel(hw, ratio, resizer):
    h, w = hw
    text = f"RandomResizedCrop(4, scale=(0.08, 0.1), ratio={ratio}), RandomHorizontalFlip()"
    aug = Augmenter(text, seed=1)
    import torch

    # torchvision's fallback rounds the thin side to 0 pixels here (a width-0 crop)
    assert 0 in torchvision_rrc(h, w, (0.08, 0.1), ratio, torch.Generator().manual_seed(0))[2:]
    for row in range(20):  # the ten tries fail every time: the fallback, one pixel
        top, left, ch, cw = aug.draw(hw, 0, row)[0]
        assert (top, left, ch, cw) == ((h - 1) // 2, (w - 1) // 2, 1, 1)
    src = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = np.empty((3, 4, 4, 3), np.uint8)
    for row in range(3):
        aug.apply(src, 0, row, out[row])
    batch = np.empty_like(out)
    aug.apply_batch(
        src.ravel(), np.zeros(3, np.int64), np.array([hw] * 3), 0, [0, 1, 2], batch
    )  # the kernel's batch path (or its fallback)
    np.testing.assert_array_equal(batch, out)


# -- a source the check at parse did not cover ----------------------------------------------
def test_a_panorama_whose_resize_would_exceed_the_bound_is_a_row_error():
    aug = Augmenter("Resize(256), CenterCrop(224)", seed=0)
    src = np.zeros((1, 300_000, 3), np.uint8)  # 256 x 76.8 M pixels after the resize
    with pytest.raises(
        RowReadError,
        match=r"Row 7: augment's Resize\(256\) makes a 256 x 76800000 "
        r"image \(19660800000 pixels, 54\.9 GiB\) from a 1 x 300000 source, over "
        r"the limit of 67108864 pixels .*leave such images out of the job",
    ) as exc:
        aug.apply(src, 0, 7, np.empty((224, 224, 3), np.uint8))
    assert exc.value.row_id == 7
    out = np.empty((1, 224, 224, 3), np.uint8)
    with pytest.raises(RowReadError, match=r"Row 9: augment's Resize\(256\)"):
        aug.apply_batch(src.ravel(), np.zeros(1, np.int64), np.array([[1, 300_000]]), 0, [9], out)
    ok = np.zeros((300, 400, 3), np.uint8)  # the usual photo
    aug.apply(ok, 0, 7, out[0])


def _png(h, w):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("decode", ["threads", "processes"])
def test_a_row_the_augmentation_may_not_take_is_skipped_or_raised_as_on_error_says(cat, decode):
    import pyarrow as pa

    # row 3: a 1 x 300000 panorama, 16 x 4.8 M pixels under Resize(16)
    pngs = [_png(12, 10), _png(10, 12), _png(9, 9), _png(1, 300_000), _png(20, 14)]
    cat.import_arrow("t", pa.table({"image": pngs}))
    cat.sql("REGISTER JOB j SELECT image FROM t WITH (augment = 'Resize(16), CenterCrop(16)')")
    with Loader(cat, decode=decode, cache_bytes=64 << 20) as loader:  # the panorama: 900 KB
        with loader.open("j", batch_size=5, epochs=1) as strict:
            with pytest.raises(
                RowReadError,
                match=r"Row 3: augment's Resize\(16\) makes a 16 x "
                r"4800000 image .* from a 1 x 300000 source",
            ) as info:
                strict.next_batch()
            assert info.value.row_id == 3
        with loader.open("j", batch_size=5, epochs=1, on_error="skip") as lenient:
            batch = lenient.next_batch()
            assert sorted(batch["_id"].tolist()) == [0, 1, 2, 4]
            assert batch["image"].shape == (4, 16, 16, 3)
            assert lenient.stats()["skipped"] == 1
        # a service's client: the batch handed over (augmented into slots of its own)
        with loader.serve("j", batch_size=5, epochs=1, on_error="skip") as handed:
            batch = handed.take()
            ids, image = batch.columns
            assert sorted(ids.value.tolist()) == [0, 1, 2, 4]
            assert len(image.starts) == 4
            release(batch.work, loader.arena)
        assert loader.arena.stats().pinned == 0


def test_a_padding_of_a_large_source_is_a_row_error():
    aug = Augmenter("RandomCrop(32, padding=2048)", seed=0)  # accepted: 8192^2 from 4096^2
    with pytest.raises(RowReadError, match=r"RandomCrop\(32, padding=.*makes a 8296 x 8296 image"):
        aug.apply(np.zeros((4200, 4200, 3), np.uint8), 0, 1, np.empty((32, 32, 3), np.uint8))


def test_a_crop_larger_than_its_padded_source_is_a_row_error():
    aug = Augmenter("RandomCrop(32, padding=2)", seed=0)
    with pytest.raises(
        RowReadError,
        match=r"^Row 4: augment's RandomCrop\(32, .*\) crops 32 x 32 from a 24 x 34 image "
        r"\(padded, from a 20 x 30 source\); give it pad_if_needed=True, or leave such",
    ):
        aug.apply(np.zeros((20, 30, 3), np.uint8), 0, 4, np.empty((32, 32, 3), np.uint8))
    fits = Augmenter("RandomCrop(32, padding=2, pad_if_needed=True)", seed=0)
    fits.apply(np.zeros((20, 30, 3), np.uint8), 0, 4, np.empty((32, 32, 3), np.uint8))


# -- the property: whatever the check accepts runs within its bound -------------------------
EXTREME = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1e-320, 1e-45, 1e-7, 101, 1e38, 1e300, 1e308, 10**9]),
)


def _ops(hostile, top, pad):
    """Strategies of one op's text, and of a Normalize's: arguments in their ranges, or
    (``hostile``) sometimes anything."""

    def maybe(valid, extreme=EXTREME):
        return st.one_of(valid, valid, valid, extreme) if hostile else valid

    def pair(valid):
        return maybe(
            st.tuples(valid, valid).map(lambda p: tuple(sorted(p))), st.tuples(EXTREME, EXTREME)
        )

    side = maybe(st.integers(1, top), st.sampled_from([-1, 0, 10**6]))
    size = st.one_of(side, st.tuples(side, side))
    padding = maybe(
        st.one_of(
            st.none(),
            st.integers(0, pad),
            st.tuples(st.integers(0, pad), st.integers(0, pad)),
            st.tuples(*[st.integers(0, pad)] * 4),
        ),
        st.sampled_from([-1, 32768, 10**9]),
    )
    normalize = st.builds(
        lambda m, s: f"Normalize({m!r}, {s!r})",
        st.tuples(*[maybe(st.floats(-10, 10))] * 3),
        st.tuples(*[maybe(st.floats(1e-6, 10))] * 3),
    )
    ops = st.one_of(
        st.builds(
            lambda s, sc, r: f"RandomResizedCrop({s!r}, scale={sc!r}, ratio={r!r})",
            size,
            pair(st.floats(1e-3, 1)),
            pair(st.floats(0.01, 100)),
        ),
        st.builds(lambda s: f"Resize({s!r})", size),
        st.builds(lambda s: f"CenterCrop({s!r})", size),
        st.builds(
            lambda s, p, f: f"RandomCrop({s!r}, padding={p!r}, pad_if_needed={f})",
            size,
            padding,
            st.booleans(),
        ),
        st.builds(lambda p: f"RandomHorizontalFlip({p!r})", maybe(st.floats(0, 1))),
    )
    return ops, normalize


def _text(draw, top, pad):
    """An augment text: half the time every argument in its range (sizes up to ``top``,
    paddings up to ``pad``), else sometimes anything, and sometimes too many ops; half the
    time ending with a Normalize."""
    hostile = draw(st.booleans())
    most = spec_module.MAX_OPS + 2 if hostile else 5
    ops, normalize = _ops(hostile, top, pad)
    chain = draw(st.lists(ops, min_size=1, max_size=most))
    if draw(st.booleans()):
        chain.append(draw(normalize))
    return ", ".join(chain).replace("inf", "1e999").replace("nan", "float('nan')")


@PROPERTY
@given(data=st.data())
def test_any_chain_is_refused_as_an_option_error_or_bounded_at_full_size(data):
    text = _text(data.draw, 1 << 15, 1 << 15)
    try:
        spec = parse_augment(text)
    except OptionError:
        return
    assert len(spec.ops) <= spec_module.MAX_OPS
    for side in (spec_module.SOURCE_SIDE, 1):
        for _, (h, w) in spec.intermediates(side, side):
            assert h * w <= spec_module.MAX_PIXELS
        assert spec.work(side, side) <= spec_module.MAX_WORK
    if spec.normalized:  # finite in float32 for every pixel value
        scale, offset = engine.normalization(spec.ops[-1])  # what the Augmenter multiplies by
        for x in (0.0, 255.0):
            assert np.isfinite(np.float32(x) * scale - offset).all()


def test_a_std_near_float32s_largest_normalizes_without_an_overflow():
    """The property above drew it (under pytest-randomly's seed): 255 * std overflowed
    float32, a RuntimeWarning that the suite, and a user's ``-W error``, make an error."""
    spec = parse_augment(
        "CenterCrop(1), Normalize((0.0, 0.0, 0.0), (1.0, 1.0, 1.3344406542812172e36))"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scale, offset = engine.normalization(spec.ops[-1])
        out = np.float32(255.0) * scale - offset
    assert np.isfinite(out).all()
    assert 0 < scale.ravel()[2] < scale.ravel()[0] == np.float32(1 / 255)


@pytest.fixture
def small_bounds(monkeypatch):
    """The bounds scaled down (a 12 x 12 source walked, 300-pixel intermediates), so that a
    chain applied to small images meets them; each allocation of the engine is recorded."""
    monkeypatch.setattr(spec_module, "SOURCE_SIDE", 12)
    monkeypatch.setattr(spec_module, "MAX_PIXELS", 300)
    made = []

    def record(fn):
        def wrapped(*args):
            out = fn(*args)
            made.append(out.shape[:2])
            return out

        return wrapped

    monkeypatch.setattr(engine, "padded", record(engine.padded))
    monkeypatch.setattr(engine, "resized", record(engine.resized))
    return made


@PROPERTY
@given(data=st.data())
def test_what_the_check_accepts_allocates_what_it_walked_within_the_bound(data, small_bounds):
    text = _text(data.draw, 24, 6)
    try:
        spec = parse_augment(text)
    except OptionError:
        return
    h, w = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    src = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    aug = Augmenter(spec, seed=3)
    out = np.empty(aug.output_shape, aug.dtype)
    walked = [hw for _, hw in spec.intermediates(h, w) if hw != (0, 0)]
    small_bounds.clear()
    why = spec.check_source(h, w)  # over the bound, or a RandomCrop larger than its input
    assert why is not None or all(a * b <= 300 for a, b in walked)
    if why is not None:  # refused before anything was allocated
        with pytest.raises(RowReadError, match=r"^Row 1: augment's "):
            aug.apply(src, epoch=0, row_id=1, out=out)
        assert small_bounds == []
        return
    aug.apply(src, epoch=0, row_id=1, out=out)  # raises nothing else
    assert all(a * b <= 300 for a, b in walked)
    for shape in small_bounds:  # each allocation is one the walk counted
        walked.remove(shape)
    if aug.dtype == np.float32:
        assert np.isfinite(out).all()


# -- the work of a whole chain --------------------------------------------------------------
def test_a_chain_is_bounded_in_its_whole_work_not_only_in_each_intermediate():
    """Every intermediate of these is within MAX_PIXELS; what a chain reads and writes is
    bounded at four of them: two upscales of a large photo to the largest size pass, three
    do not (a chain of 15 cost 3.45 s of CPU a row in the shared pool, and was accepted)."""
    up = "Resize(8192), Resize(8191), "
    twice = parse_augment(up + "CenterCrop(224)")
    side = spec_module.SOURCE_SIDE
    # each resize reads its input and writes its output; the crop writes the batch slot
    assert twice.work(side, side) == side**2 + 2 * 8192**2 + 8191**2 + 224**2
    with pytest.raises(
        OptionError,
        match=r"^augment = 'Resize\(8192\), Resize\(8191\), Resize\(8192\), CenterCrop\(224\)' "
        r"reads and writes 352 M pixels for one 4096 x 4096 image \(4 operations\), over the "
        r"limit of 268 M pixels for a whole chain \(the shared decode pool runs it for every row "
        r"of the job\); use fewer or smaller resizes .*, e\.g\. augment = 'RandomResizedCrop",
    ):
        parse_augment(up + "Resize(8192), CenterCrop(224)")
    for usual in ("RandomResizedCrop(224), RandomHorizontalFlip()", "Resize(256), CenterCrop(224)"):
        assert parse_augment(usual).work(side, side) < spec_module.MAX_WORK / 15
    # padding counts, walked from a 1 x 1 source too: five pads to 8191 x 8191
    pads = ", ".join(["RandomCrop(4096, pad_if_needed=True)", "RandomCrop(1)"] * 5)
    with pytest.raises(
        OptionError, match=r"335 M pixels for one 1 x 1 image \(10 operations\), over the limit"
    ):
        parse_augment(pads)


# -- every entry point refuses a bad text alike ---------------------------------------------
BAD = [
    ("CenterCrop(" + "-" * 1500 + "1)", r"CenterCrop's size = -+\.\.\. is not a number"),
    ("RandomCrop(8, padding=32768)", r"makes a 69632 x 69632 image"),
    ("RandomResizedCrop(32, ratio=(1e308, 1e308))", r"ratio = \(1e\+308, 1e\+308\) is not a range"),
    ("CenterCrop(8), Normalize(0.5, 1e-45)", r"std = 1e-45 is below 1e-06"),
    (", ".join(["Resize((64, 64))"] * 17), r"lists 17 operations, over the 16 allowed"),
    (
        ", ".join(["Resize(8192)", "Resize(8191)"] * 7 + ["Resize(8192)", "CenterCrop(8)"]),
        r"augment = 'Resize\(8192\), Resize\(8191\), .*\.\.\.' reads and writes 1963 M pixels "
        r"for one 4096 x 4096 image \(16 operations\), over the limit of 268 M pixels for a whole "
        r"chain .*; use fewer or smaller resizes",
    ),
]


@pytest.mark.parametrize(("text", "match"), BAD)
def test_register_and_open_refuse_a_bad_text_alike(images, text, match):
    images.sql("REGISTER JOB ev SELECT image FROM imgs WITH (image_size = 8)")
    with pytest.raises(OptionError, match=match):
        images.register_job("j", "imgs", columns=["image"], options={"augment": text})
    quoted = text.replace("'", "''")
    with pytest.raises(OptionError, match=match):
        images.sql(f"REGISTER JOB k SELECT image FROM imgs WITH (augment = '{quoted}')")
    with Loader(images, cache_bytes=8 << 20) as loader:
        with pytest.raises(OptionError, match=match):
            loader.open("ev", augment=text)
        with pytest.raises(OptionError, match=match):
            JobDataset("ev", loader=loader, augment=text)
    assert not {"j", "k"} & set(images.job_names())


@pytest.mark.parametrize(
    ("attrs", "match"),
    [
        ({"ratio": (1e308, 1e308)}, r"ratio = \(1e\+308, 1e\+308\) is not a range"),
        ({"ratio": (float("inf"), float("inf"))}, r"ratio = inf is not a number"),
        ({"ratio": (float("nan"), 1.0)}, r"ratio = nan is not a number"),
        ({"size": [32768]}, r"RandomResizedCrop\(32768, .*\) makes a 32768 x 32768 image"),
    ],
)
def test_a_torchvision_compose_out_of_range_is_refused_at_open(images, attrs, match):
    def op(name, **attrs):
        return type(name, (), attrs)()

    rrc = {"size": [32], "scale": (0.08, 1.0), "ratio": (0.75, 4 / 3)} | attrs
    compose = types.SimpleNamespace(transforms=[op("RandomResizedCrop", **rrc)])
    images.sql("REGISTER JOB ev SELECT image FROM imgs WITH (image_size = 8)")
    with Loader(images, cache_bytes=8 << 20) as loader, pytest.raises(OptionError, match=match):
        JobDataset("ev", loader=loader, augment=compose)


def test_a_job_registered_before_a_bound_is_refused_at_its_open_alone(images):
    """A catalog from before these bounds may hold a text they refuse: that job's open says
    why; the other augmented jobs on its rows still open."""
    old = ", ".join(["RandomHorizontalFlip()"] * 20) + ", RandomResizedCrop(16)"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(spec_module, "MAX_OPS", 32)
        images.sql(f"REGISTER JOB old SELECT image FROM imgs WITH (augment = '{old}')")
    images.sql("REGISTER JOB new SELECT image FROM imgs WITH (augment = 'RandomResizedCrop(8)')")
    with Loader(images, cache_bytes=32 << 20) as loader:
        with pytest.raises(OptionError, match=r"augment lists 21 operations, over the 16"):
            loader.open("old")
        with loader.open("new", batch_size=4, epochs=1) as s:
            assert s.take()["image"].shape == (4, 8, 8, 3)
