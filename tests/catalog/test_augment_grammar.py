"""The ``augment`` option's grammar: what parses, what it means, and every refusal."""

from __future__ import annotations

import pytest

from catalog.augment import OPERATIONS, parse_augment
from catalog.errors import OptionError
from catalog.options import check_options


def test_every_operation_parses_with_torchvisions_defaults():
    spec = parse_augment(
        "RandomResizedCrop(224), Resize(256), CenterCrop(224), RandomCrop(32), "
        "RandomHorizontalFlip(), Normalize(0.5, 0.25)"
    )
    assert [op.name for op in spec.ops] == list(OPERATIONS)
    rrc, _, _, crop, flip, norm = spec.ops
    assert rrc.arg("scale") == (0.08, 1.0)
    assert rrc.arg("ratio") == (3 / 4, 4 / 3)
    assert crop.arg("padding") is None
    assert crop.arg("pad_if_needed") is False
    assert crop.arg("fill") == 0
    assert flip.arg("p") == 0.5
    assert norm.arg("mean") == (0.5,) * 3
    assert norm.arg("std") == (0.25,) * 3


def test_canonical_text_parses_back_to_the_same_spec():
    spec = parse_augment(
        "RandomResizedCrop((200, 100), scale=(0.25, 0.5)), RandomCrop(size=24, padding=(1, 2), "
        "pad_if_needed=True, fill=7), RandomHorizontalFlip(p=0.25)"
    )
    assert parse_augment(spec.text) == spec
    assert spec.ops[1].arg("padding") == (1, 2, 1, 2)  # (left/right, top/bottom) as torchvision


@pytest.mark.parametrize(
    ("text", "shape", "need"),
    [
        ("RandomResizedCrop(224), RandomHorizontalFlip()", (224, 224, 3), 224),
        ("Resize(256), CenterCrop(224)", (224, 224, 3), 256),
        ("RandomCrop((24, 32), padding=4)", (24, 32, 3), 32),
        ("Resize((10, 20)), Normalize((0.1, 0.2, 0.3), (1, 2, 3))", (3, 10, 20), 20),
    ],
)
def test_output_shape_and_need(text, shape, need):
    spec = parse_augment(text)
    assert spec.output_shape == shape
    assert spec.need == need


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("RandomResizedCrops(224)", r"unknown operation 'RandomResizedCrops'\. Did you mean "),
        ("ColorJitter(0.4)", r"unknown operation 'ColorJitter'.*Known: RandomResizedCrop"),
        ("__import__('os').system('true')", r"not an operation call"),
        ("RandomResizedCrop(224", r"not a list of operations \(column \d+"),
        ("", r"augment is empty"),
        ("Resize(256)", r"output size varies with the image"),
        ("CenterCrop(8), Resize(4)", r"output size varies with the image"),
        ("Normalize(0.5, 0.5), CenterCrop(8)", r"Normalize must be the last operation"),
        ("RandomResizedCrop()", r"needs its argument 'size', e\.g\. RandomResizedCrop\(224\)"),
        ("RandomResizedCrop(0)", r"size = 0 is not a size"),
        ("RandomResizedCrop(40000)", r"size = 40000 is not a size.*1 to 32768"),
        ("CenterCrop((1, 2, 3))", r"size = \(1, 2, 3\) is not a size"),
        ("CenterCrop(True)", r"size = True is not a size"),
        ("CenterCrop('a')", r"size = 'a' is not a number or a tuple of numbers"),
        ("CenterCrop(x)", r"size = x is not a number"),
        ("RandomResizedCrop(8, scale=(0.5, 0.1))", r"scale = \(0\.5, 0\.1\) is not a range"),
        ("RandomResizedCrop(8, scale=(0, 1))", r"scale = \(0, 1\) is not a range"),
        ("RandomResizedCrop(8, ratio=(2, 1))", r"ratio = \(2, 1\) is not a range"),
        ("RandomResizedCrop(8, bogus=1)", r"RandomResizedCrop has no argument 'bogus'"),
        ("RandomResizedCrop(8, size=8)", r"got argument 'size' twice"),
        ("CenterCrop(8, 9)", r"CenterCrop takes at most 1 arguments"),
        ("RandomCrop(8, padding=-1)", r"padding = -1 is not a padding"),
        ("RandomCrop(8, pad_if_needed=1)", r"pad_if_needed = 1 is not True or False"),
        ("RandomCrop(8, fill=300)", r"fill = 300 is not a pixel value"),
        ("CenterCrop(8), RandomHorizontalFlip(1.5)", r"p = 1\.5 is not a probability"),
        ("CenterCrop(8), Normalize(0.5, 0)", r"std = 0 must be positive"),
        ("CenterCrop(8), Normalize((1, 2), 1)", r"mean = \(1, 2\) is not one number or three"),
        ("CenterCrop(8), Normalize(float('nan'), 1)", r"not a number or a tuple"),
        ("CenterCrop(8), Normalize(1e999, 1)", r"mean = inf is not one number or three"),
    ],
)
def test_bad_text_is_refused_naming_the_problem(text, match):
    with pytest.raises(OptionError, match=match):
        parse_augment(text)


def test_long_or_non_string_text_is_refused():
    with pytest.raises(OptionError, match=r"over the 2000 allowed"):
        parse_augment("RandomHorizontalFlip(), " * 200 + "CenterCrop(8)")
    with pytest.raises(OptionError, match=r"augment = 3 is not a string"):
        parse_augment(3)


def test_register_stores_the_canonical_text(cat, tmp_path):
    import pyarrow as pa

    cat.import_arrow("t", pa.table({"image": [b"x"], "label": [1]}))
    job = cat.register_job("j", "t", options={"augment": "RandomResizedCrop(32)"})
    assert job.options["augment"] == parse_augment("RandomResizedCrop(32)").text
    cat.sql(
        "REGISTER JOB k SELECT image FROM t WITH (augment = 'Resize(40), CenterCrop(32)', "
        "decode_size = 64)"
    )
    assert cat.job("k").options == {"augment": "Resize(40), CenterCrop(32)", "decode_size": 64}
    with pytest.raises(OptionError, match=r"Did you mean RandomCrop"):
        cat.sql("REGISTER JOB m SELECT image FROM t WITH (augment = 'RandomCrap(8)')")
    assert "m" not in cat.job_names()


def test_a_batch_of_augmented_images_is_bounded_in_memory():
    with pytest.raises(OptionError, match=r"augment makes one batch of 65536 images .* GiB"):
        check_options({"batch_size": 65536, "augment": "CenterCrop(512), Normalize(0, 1)"})
    assert check_options({"batch_size": 64, "augment": "CenterCrop(224)"})["batch_size"] == 64
