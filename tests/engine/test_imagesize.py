"""Declared sizes from image headers, and the pixel limit checked before any decoder runs."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import tabloader.engine.decode._images as codec
from tabloader.catalog._errors import CatalogError, LoaderError
from tabloader.engine._prepare import prep
from tabloader.engine._prepare.imagesize import check_pixels, declared_size
from tabloader.engine.decode import decode_image, decode_images, pixel_limit
from tests.support.bombs import bomb, image_bytes, with_size


@pytest.fixture(autouse=True)
def _default_limit(monkeypatch):
    """The default pixel limit, whatever this environment sets."""
    monkeypatch.delenv("TABLOADER_MAX_IMAGE_MEGAPIXELS", raising=False)


FORMATS = {
    "jpeg": lambda: image_bytes("JPEG"),
    "progressive": lambda: image_bytes("JPEG", progressive=True),
    "png": lambda: image_bytes("PNG"),
    "webp-lossy": lambda: image_bytes("WEBP"),
    "webp-lossless": lambda: image_bytes("WEBP", lossless=True),
    "webp-extended": lambda: image_bytes("WEBP", exif=b"Exif\x00\x00tiny"),
    "gif": lambda: image_bytes("GIF"),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_declares_its_size_and_a_patched_one(fmt):
    data = FORMATS[fmt]()
    assert declared_size(data) == (40, 30)
    assert declared_size(memoryview(data)) == (40, 30)
    assert declared_size(with_size(data, 9000, 7000)) == (9000, 7000)
    if fmt == "webp-extended":
        assert data[12:16] == b"VP8X"


def test_other_formats_are_left_to_pillow():
    assert declared_size(image_bytes("BMP")) is None
    assert declared_size(b"") is None
    assert declared_size(b"RIFF\0\0\0\0WAVEfmt ") is None


def test_a_jpeg_frame_header_is_found_past_other_segments_fill_and_garbage():
    data = image_bytes("JPEG")
    app = b"\xff\xe1" + struct.pack(">H", 2 + 3000) + b"\xff\xc0" * 1500  # a fake SOF inside
    extra = app + b"\xff\xfe\x00\x04hi" + b"junk" + b"\xff\xff\xff\xd0"  # COM, garbage, RST0
    assert declared_size(data[:2] + extra + data[2:]) == (40, 30)


def test_a_gif_frame_larger_than_its_screen_widens_the_size():
    data = bytearray(image_bytes("GIF"))
    at = 13 + (3 << ((data[10] & 7) + 1))  # past the color table: the frame (no extension)
    assert data[at] == 0x2C
    struct.pack_into("<HH", data, at + 1, 60000, 0)  # the frame at x=60000, 40 wide
    assert declared_size(bytes(data)) == (60040, 30)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_truncated_header_is_refused_or_read_never_a_crash(fmt):
    data = FORMATS[fmt]()
    for cut in range(len(data)):
        try:
            size = declared_size(data[:cut])
        except LoaderError as exc:
            message = str(exc)
            size = None
        else:
            message = "header is damaged"
        assert "header is damaged" in message
        assert size is None or size[0] * size[1] > 0


def test_garbage_after_a_magic_is_refused_or_read_never_a_crash():
    rng = np.random.default_rng(7)
    magics = [b"\xff\xd8", b"\x89PNG\r\n\x1a\n", b"RIFF\0\0\0\0WEBPVP8 ", b"GIF89a"]
    for i in range(400):
        tail = rng.integers(0, 256, int(rng.integers(0, 80)), dtype=np.uint8).tobytes()
        try:
            size = declared_size(magics[i % 4] + tail)
        except LoaderError as exc:
            message, size = str(exc), (1, 1)
        else:
            message = "header is damaged"
        assert "header is damaged" in message
        assert isinstance(size, tuple)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\xff\xd8\xff\xd9", r"JPEG header is damaged \(marker 0xD9 before any frame header"),
        (b"\xff\xd8\xff\xe0\x00\x01", "segment 0xE0 has length 1"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "no frame header"),
        (b"\xff\xd8\xff\xc0\x00\x11\x08\x00\x00\x00\x10", r"declares 16x0 \(DNL"),
        (b"\xff\xd8\xff\xc2\x00\x11\x08\x00", "end before its frame header"),
        (b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDX" + bytes(8), "first chunk is b'IHDX', not IHDR"),
        (b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR" + bytes(8), "IHDR declares 0x0"),
        (b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR", "end before its IHDR chunk"),
        (b"RIFF\0\0\0\0WEBPABCD\0\0\0\0", "first chunk is b'ABCD'"),
        (b"RIFF\0\0\0\0WEBPVP8 \0\0\0\0" + bytes(10), "no VP8 start code"),
        (b"RIFF\0\0\0\0WEBPVP8L\0\0\0\0" + bytes(5), "no VP8L signature"),
        (b"GIF89a\x10\x00", "end before its logical screen"),
    ],
)
def test_malformed_headers_are_refused_naming_the_problem(data, match):
    with pytest.raises(LoaderError, match=match):
        declared_size(data)


def test_the_refusal_names_the_size_the_limit_and_how_to_raise_it():
    check_pixels((8000, 8000), 64_000_000)
    with pytest.raises(
        LoaderError,
        match=r"declares 65500x65500 pixels \(4290\.2 megapixels\), over the limit of 64 "
        r"megapixels, so it was refused before decoding .*--max-image-megapixels N, "
        r"\$TABLOADER_MAX_IMAGE_MEGAPIXELS or Loader\(max_image_megapixels=N\)",
    ):
        check_pixels((65500, 65500), 64_000_000)


@pytest.fixture
def no_decoder(monkeypatch):
    """Any decoder call fails the test: a refusal must come from the header alone."""

    def called(*args, **kw):
        raise AssertionError("a decoder ran")

    monkeypatch.setattr(codec.simplejpeg, "decode_jpeg", called)
    monkeypatch.setattr(codec.simplejpeg, "decode_jpeg_header", called)
    monkeypatch.setattr(codec.Image, "open", called)


@pytest.mark.parametrize("kind", ["progressive", "jpeg", "png", "webp", "gif"])
@pytest.mark.parametrize("size", [None, 32, (24, 16), prep.Fit(32)])
def test_bombs_are_refused_before_any_decoder_runs(kind, size, no_decoder):
    data = bomb(kind)
    assert len(data) < 8000
    slot = []
    with pytest.raises(LoaderError, match="refused before decoding"):
        decode_image(data, size=size, into=lambda shape: slot.append(shape))
    assert not slot  # nothing reserved for it
    if size is not None and not isinstance(size, prep.Fit):
        (got,) = decode_images([data], size=size)
        assert isinstance(got, LoaderError)
        assert "refused before decoding" in str(got)


def test_a_decoder_refuses_a_row_naming_it():
    dec = prep.Decoder("image", prep.DecodeKind.IMAGE, image_size=16, max_pixels=10**6)
    (err,) = dec.many([bomb("png")], [7])
    assert err.row_id == 7
    assert str(err).startswith("row 7, column 'image': the image declares 13000x13000 pixels")


def test_pillow_formats_are_checked_by_the_size_pillow_reads(monkeypatch):
    data = image_bytes("BMP", (50, 40))
    assert decode_image(data, max_pixels=2000).shape == (40, 50, 3)
    monkeypatch.setattr(codec.Image.Image, "load", lambda self: pytest.fail("decoded"))
    with pytest.raises(LoaderError, match=r"declares 50x40 pixels .* over the limit of 0\.001"):
        decode_image(data, max_pixels=1000)


def test_the_pixel_limit_is_a_checked_setting(monkeypatch):
    assert pixel_limit() == 64_000_000
    assert pixel_limit(3) == 3_000_000
    data = image_bytes("JPEG", (1500, 1000))
    monkeypatch.setenv("TABLOADER_MAX_IMAGE_MEGAPIXELS", "2")
    assert pixel_limit() == 2_000_000
    assert decode_image(data).shape == (1000, 1500, 3)
    monkeypatch.setenv("TABLOADER_MAX_IMAGE_MEGAPIXELS", "1")
    with pytest.raises(LoaderError, match="over the limit of 1 megapixels"):
        decode_image(data)
    monkeypatch.setenv("TABLOADER_MAX_IMAGE_MEGAPIXELS", "lots")
    with pytest.raises(
        CatalogError, match=r"\$TABLOADER_MAX_IMAGE_MEGAPIXELS 'lots' is not a whole number"
    ):
        pixel_limit()
    with pytest.raises(LoaderError, match="max_image_megapixels 0 is below the range"):
        pixel_limit(0)
