from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

import tabloader.engine.decode._images as codec
from tabloader.catalog._errors import LoaderError, RowReadError
from tabloader.engine import decode
from tabloader.engine._prepare import prep
from tabloader.engine._prepare.prep import DecodeKind, Decoder, batch_column, decoder_for
from tabloader.engine.decode import decode_image


def gradient(w: int = 500, h: int = 375) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], axis=-1).astype(np.uint8)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def pil_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return encode(Image.fromarray(gradient()), "JPEG", quality=90)


@pytest.fixture(scope="module")
def png() -> bytes:
    return encode(Image.fromarray(gradient()), "PNG")


# ---------------------------------------------------------------- decode_image


def test_png_decodes_exactly(png):
    arr = decode_image(png)
    assert arr.dtype == np.uint8
    assert arr.shape == (375, 500, 3)
    np.testing.assert_array_equal(arr, gradient())


def test_jpeg_full_size_equals_pillow(jpeg):
    np.testing.assert_array_equal(decode_image(jpeg), pil_rgb(jpeg))


@pytest.mark.parametrize("wrap", [bytes, memoryview, bytearray, pa.py_buffer])
def test_accepts_buffer_types(png, wrap):
    np.testing.assert_array_equal(decode_image(wrap(png)), gradient())


def test_result_is_read_only(png):
    arr = decode_image(png)
    with pytest.raises(ValueError, match="read-only"):
        arr[0, 0, 0] = 1


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_size_int_resizes_shorter_side_and_center_crops(fmt):
    data = encode(Image.fromarray(gradient()), fmt)
    arr = decode_image(data, size=224)
    assert arr.shape == (224, 224, 3)
    # center crop: the red channel (x gradient) is symmetric around the middle column
    full = gradient()
    assert arr[:, 112, 0].mean() == pytest.approx(full[:, 250, 0].mean(), abs=3)


def test_size_tuple_resizes_exactly(png):
    arr = decode_image(png, size=(100, 60))
    assert arr.shape == (100, 60, 3)


def test_size_equal_to_image_is_identity(png):
    np.testing.assert_array_equal(decode_image(png, size=(375, 500)), gradient())


def test_center_crop_matches_resize_then_crop(png):
    # the documented transform: shorter side to 224, then center crop 224 x 224
    img = Image.open(io.BytesIO(png)).convert("RGB")
    resized = np.asarray(img.resize((299, 224), Image.Resampling.BILINEAR), dtype=np.int16)
    left = (299 - 224) // 2
    expected = resized[:, left : left + 224]
    got = decode_image(png, size=224).astype(np.int16)
    assert np.abs(got - expected).mean() < 2.0


@pytest.mark.parametrize("size", [224, 96, (100, 60), (375, 300), (500, 700), 400])
def test_resize_is_pillows_bilinear(png, resizer, size):
    """Either way, the pixels of Pillow's BILINEAR resize of the center square (or the whole
    image for a (height, width)), give or take 1 in a few values."""
    img = Image.open(io.BytesIO(png)).convert("RGB")
    if isinstance(size, int):
        img = pil_image_center_square(png)
        expected = img.resize((size, size), Image.Resampling.BILINEAR)
    else:
        expected = img.resize(size[::-1], Image.Resampling.BILINEAR)
    got = decode_image(png, size=size).astype(np.int16)
    diff = np.abs(got - np.asarray(expected, dtype=np.int16))
    assert got.shape == diff.shape
    assert diff.max() <= 1
    assert (diff > 0).mean() < 0.01


def test_jpeg_draft_is_deterministic_and_close():
    big = Image.fromarray(gradient()).resize((2000, 1500), Image.Resampling.BILINEAR)
    data = encode(big, "JPEG", quality=90)
    a = decode_image(data, size=224)
    b = decode_image(data, size=224)
    np.testing.assert_array_equal(a, b)
    reference = np.asarray(
        pil_image_center_square(data).resize((224, 224), Image.Resampling.BILINEAR),
        dtype=np.int16,
    )
    assert np.abs(a.astype(np.int16) - reference).mean() < 3.0


def pil_image_center_square(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = img.size
    m = min(w, h)
    return img.crop(((w - m) // 2, (h - m) // 2, (w + m) // 2, (h + m) // 2))


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA", "1"])
def test_other_modes_become_rgb(mode):
    img = Image.fromarray(gradient(40, 30)).convert(mode)
    data = encode(img, "PNG")
    arr = decode_image(data)
    assert arr.shape == (30, 40, 3)
    np.testing.assert_array_equal(arr, pil_rgb(data))


def test_palette_with_byte_transparency_becomes_rgb():
    img = Image.fromarray(gradient(40, 30)).convert("P")
    data = encode(img, "PNG", transparency=bytes([0, 128] + [255] * 254))
    assert Image.open(io.BytesIO(data)).info["transparency"]
    arr = decode_image(data)  # would warn (an error under filterwarnings) via P -> RGB
    assert arr.shape == (30, 40, 3)


def test_sixteen_bit_grayscale_keeps_high_byte():
    values = np.full((10, 12), 0xAB12, dtype=np.uint16)
    data = encode(Image.fromarray(values), "PNG")
    arr = decode_image(data)
    assert arr.shape == (10, 12, 3)
    assert (arr == 0xAB).all()


def test_grayscale_jpeg_with_size():
    data = encode(Image.fromarray(gradient()).convert("L"), "JPEG")
    assert decode_image(data, size=64).shape == (64, 64, 3)


def test_corrupt_bytes_raise_clear_error():
    with pytest.raises(
        LoaderError, match=r"\(12 bytes starting b'not an i'\): not a known image format\. The"
    ):
        decode_image(b"not an image")


def test_truncated_jpeg_raises(jpeg):
    with pytest.raises(LoaderError, match=r"Cannot decode image.*not a valid image"):
        decode_image(jpeg[: len(jpeg) // 2])


@pytest.mark.parametrize("size", [0, -3, (224,), (0, 10), 2.5, True, "224"])
def test_invalid_size_raises(png, size):
    with pytest.raises(LoaderError, match="image size must be a positive int"):
        decode_image(png, size=size)


# ---------------------------------------------------------------- decoders


@pytest.mark.parametrize(
    ("image_size", "key"),
    [(None, "image@rgb"), (224, "image@224"), ((224, 160), "image@224x160")],
)
def test_decoder_keys_include_parameters(image_size, key):
    dec = decoder_for(pa.field("image", pa.binary()), image_size=image_size)
    assert dec.kind is DecodeKind.IMAGE
    assert dec.key == key


def test_decoder_keys_differ_by_parameters_and_match_when_equal():
    field = pa.field("img", pa.large_binary())
    a = decoder_for(field, image_size=224)
    b = decoder_for(field, image_size=224)
    c = decoder_for(field, image_size=128)
    d = decoder_for(field, image_columns=())
    assert a == b
    assert a.key == b.key
    assert len({a.key, c.key, d.key, decoder_for(field).key}) == 4
    assert d.kind is DecodeKind.BYTES
    assert d.key == "img"
    assert hash(a) == hash(b)


def test_decoder_for_picks_kinds():
    assert decoder_for(pa.field("image", pa.binary())).kind is DecodeKind.IMAGE
    assert decoder_for(pa.field("IMG", pa.binary())).kind is DecodeKind.IMAGE
    assert decoder_for(pa.field("payload", pa.binary())).kind is DecodeKind.BYTES
    assert decoder_for(pa.field("image", pa.string())).kind is DecodeKind.SCALAR  # a path
    assert decoder_for(pa.field("label", pa.int64())).dtype == "int64"
    assert decoder_for(pa.field("emb", pa.list_(pa.float32(), 4))).kind is DecodeKind.ARRAY
    hf = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert decoder_for(pa.field("pixels", hf)).kind is DecodeKind.IMAGE
    custom = decoder_for(pa.field("scan", pa.binary()), image_columns={"scan"}, image_size=32)
    assert custom.kind is DecodeKind.IMAGE
    assert custom.key == "scan@32"
    assert decoder_for(pa.field("label", pa.int8()), image_size=224).key == "label"


def test_image_columns_must_hold_bytes():
    with pytest.raises(LoaderError, match="column 'label' is int64, not binary"):
        decoder_for(pa.field("label", pa.int64()), image_columns=["label"])


def test_decoder_rejects_size_for_non_images():
    with pytest.raises(LoaderError, match="only image columns take a size"):
        Decoder("label", DecodeKind.SCALAR, image_size=224)


def test_image_decoder_on_arrow_values(png):
    arr = pa.array([png], pa.binary())
    dec = decoder_for(pa.field("image", pa.binary()), image_size=(20, 30))
    value, nbytes = dec(arr[0], row_id=4)
    assert value.shape == (20, 30, 3)
    assert nbytes == 20 * 30 * 3
    hf = pa.array([{"bytes": png, "path": "a.png"}])
    value, _ = decoder_for(pa.field("image", hf.type))(hf[0])
    np.testing.assert_array_equal(value, gradient())


def test_decoder_wraps_errors_with_row_id():
    dec = decoder_for(pa.field("image", pa.binary()))
    with pytest.raises(RowReadError, match="row 17, column 'image': Cannot decode image") as info:
        dec(pa.scalar(b"garbage", pa.binary()), row_id=17)
    assert info.value.row_id == 17
    assert info.value.column == "image"
    assert isinstance(info.value.__cause__, LoaderError)
    with pytest.raises(LoaderError, match="Cannot decode image") as plain:
        dec(b"garbage")
    assert not isinstance(plain.value, RowReadError)


def test_null_image_raises():
    dec = decoder_for(pa.field("image", pa.binary()))
    with pytest.raises(RowReadError, match=r"is null in this row.*image IS NOT NULL"):
        dec(pa.scalar(None, pa.binary()), row_id=2)


def test_scalar_and_array_decoders():
    label = decoder_for(pa.field("label", pa.int16()))
    value, nbytes = label(pa.scalar(7, pa.int16()))
    assert value == 7
    assert value.dtype == np.int16
    assert nbytes == 2
    assert label(5)[0].dtype == np.int16
    flag, _ = decoder_for(pa.field("ok", pa.bool_()))(pa.scalar(True))
    assert flag.dtype == np.bool_
    text, nbytes = decoder_for(pa.field("caption", pa.string()))(pa.scalar("a cat"))
    assert text == "a cat"
    assert nbytes > 0
    raw, _ = decoder_for(pa.field("blob", pa.binary()))(pa.scalar(b"\x00\x01"))
    assert raw == b"\x00\x01"
    emb_type = pa.list_(pa.float32(), 3)
    emb, nbytes = decoder_for(pa.field("emb", emb_type))(pa.array([[1, 2, 3]], emb_type)[0])
    assert emb.dtype == np.float32
    assert emb.shape == (3,)
    assert nbytes == 12
    assert not emb.flags.writeable
    nested_type = pa.list_(pa.list_(pa.int32()))
    nested, _ = decoder_for(pa.field("m", nested_type))(
        pa.array([[[1, 2], [3, 4]]], nested_type)[0]
    )
    assert nested.shape == (2, 2)
    assert nested.dtype == np.int32
    assert decoder_for(pa.field("label", pa.int64()))(pa.scalar(None, pa.int64())) == (None, 0)


# ---------------------------------------------------------------- batch_column


def _column(values, type_=None, name="x"):
    arr = pa.array(values, type=type_)
    return batch_column(arr, decoder_for(pa.field(name, arr.type)))


def test_batch_column_numbers_keep_their_dtype_and_are_writable():
    out = _column([1, 2, 3], pa.int16())
    assert out.dtype == np.int16
    assert out.tolist() == [1, 2, 3]
    assert out.flags.writeable
    assert out.flags.owndata
    assert _column([0.5, 1.5]).dtype == np.float64
    assert _column([True, False]).dtype == np.bool_


def test_batch_column_fixed_and_equal_lists_stack():
    fixed = _column([[1, 2], [3, 4], [5, 6]], pa.list_(pa.float32(), 2))
    assert fixed.shape == (3, 2)
    assert fixed.dtype == np.float32
    equal = _column([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int32()))
    assert equal.shape == (2, 3)
    assert equal.tolist() == [[1, 2, 3], [4, 5, 6]]
    ragged = _column([[1], [2, 3]], pa.list_(pa.int64()))
    assert [a.tolist() for a in ragged] == [[1], [2, 3]]
    assert all(a.flags.writeable for a in ragged)


def test_batch_column_sliced_list_array():
    arr = pa.array([[9], [1, 2], [3, 4], [5]], pa.list_(pa.int64())).slice(1, 2)
    out = batch_column(arr, decoder_for(pa.field("x", arr.type)))
    assert out.tolist() == [[1, 2], [3, 4]]


def test_batch_column_strings_bytes_nulls_and_big_ints_give_lists():
    assert _column(["a", "b"]) == ["a", "b"]
    assert _column([b"\x00", b"\x01"], name="blob") == [b"\x00", b"\x01"]
    assert _column([3, None]) == [3, None]
    assert _column([[1], None], pa.list_(pa.int64())) == [[1], None]


# ---------------------------------------------------------------- batched: decode_images, many


def _mixed_images() -> list:
    """Images of several sources and sizes (JPEG, PNG, grayscale, tiny), some twice, some
    broken: what one decode task may hold."""
    rng = np.random.default_rng(0)
    out: list = []
    for w, h in ((24, 24), (24, 24), (40, 30), (30, 40), (500, 375), (24, 24), (17, 9)):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out.append(encode(Image.fromarray(pixels), "JPEG", quality=90))
        out.append(encode(Image.fromarray(pixels), "PNG"))
    out.append(encode(Image.fromarray(gradient(64, 48)).convert("L"), "JPEG"))
    out.append(b"not an image")
    out.append(out[0][: len(out[0]) // 3])  # truncated
    return out


def outcome(fn):
    """``fn()``, or the ``LoaderError`` it raised."""
    try:
        return fn()
    except LoaderError as exc:
        return exc


@pytest.mark.parametrize("size", [16, 8, (12, 20), 224])
def test_decode_images_is_decode_image_of_each(size):
    values = _mixed_images()
    got = decode.decode_images([pa.py_buffer(v) for v in values], size=size)
    assert len(got) == len(values)
    for value, arr in zip(values, got, strict=True):
        want = outcome(lambda v=value: decode_image(v, size=size))
        if isinstance(want, LoaderError):
            assert isinstance(arr, LoaderError)
            assert str(arr) == str(want)
            continue
        assert not isinstance(arr, LoaderError)
        np.testing.assert_array_equal(arr, want)
        assert not arr.flags.writeable


def test_resize_many_is_resize_hw_of_each():
    rng = np.random.default_rng(1)
    arrs = rng.integers(0, 256, (9, 31, 23, 3), dtype=np.uint8)
    for out_h, out_w in ((16, 16), (7, 40), (31, 23)):
        got = codec.resize_many_hw(arrs, out_h, out_w)
        for a, g in zip(arrs, got, strict=True):
            np.testing.assert_array_equal(g, codec.resize_hw(a, out_h, out_w))


@pytest.mark.parametrize("image_size", [None, 16, (12, 20), prep.Fit(20)])
def test_decoder_many_is_the_decoder_on_each_value(image_size):
    dec = decoder_for(pa.field("image", pa.binary()), image_size=image_size)
    values: list = _mixed_images()
    values.insert(3, None)  # a null fails as the decoder fails it
    rows = list(range(100, 100 + len(values)))
    got = dec.many(values, rows)
    for value, row, out in zip(values, rows, got, strict=True):
        want = outcome(lambda v=value, r=row: dec(v, row_id=r)[0])
        if isinstance(want, LoaderError):
            assert type(out) is type(want) is RowReadError
            assert (str(out), out.row_id, out.column) == (str(want), row, "image")
            continue
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("fit", [prep.Fit(16), prep.Fit(100), prep.Fit(16, cap=20)])
def test_a_fit_decode_goes_into_the_array_given_when_its_shape_is_known(fit):
    """An aspect-kept JPEG decode that needs no resize after its DCT scale is written into
    ``into``'s array (the arena's slot): the same pixels, no array of its own; with a resize
    after it (a cap under the decoded side), or not a JPEG, ``into`` is not used."""
    rng = np.random.default_rng(1)
    data = encode(Image.fromarray(rng.integers(0, 256, (90, 120, 3), np.uint8)), "JPEG")
    want = decode_image(data, size=fit)
    given: list = []

    def into(shape):
        given.append(np.zeros(shape, np.uint8))
        return given[-1]

    got = decode_image(data, size=fit, into=into)
    np.testing.assert_array_equal(got, want)
    assert not got.flags.writeable
    if fit.cap is not None:  # 90 -> a 45 or 90 decode, over the cap: resized after
        assert given == []
    else:
        assert [g.shape for g in given] == [want.shape]
        assert np.shares_memory(got, given[0])
    png = encode(Image.fromarray(rng.integers(0, 256, (9, 12, 3), np.uint8)), "PNG")
    assert decode_image(png, size=fit, into=into).shape[:2] == (9, 12)
    assert len(given) == (0 if fit.cap is not None else 1)  # a PNG never asks
