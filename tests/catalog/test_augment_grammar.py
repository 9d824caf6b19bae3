"""The ``augment`` option's grammar: what parses, what it means, and every refusal."""

from __future__ import annotations

import pytest

from tabloader.catalog._augment import MAX_OPS, MIN_STD, OPERATIONS, parse_augment
from tabloader.catalog._errors import OptionError
from tabloader.catalog._options import check_options


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
        (
            "RandomResizedCrop(8, scale=(0.5, 1.5))",
            r"scale = \(0\.5, 1\.5\) .*0 < low <= high <= 1",
        ),
        ("RandomResizedCrop(8, scale=(-1, 1))", r"scale = \(-1, 1\) is not a range"),
        (
            "RandomResizedCrop(32, ratio=(1e308, 1e308))",
            r"ratio = \(1e\+308, 1e\+308\) is not a range; .*0\.01 <= low <= high <= 100",
        ),
        ("RandomResizedCrop(32, ratio=(1e-320, 1e-320))", r"ratio = \(1e-320, 1e-320\) is not"),
        ("RandomResizedCrop(32, ratio=(1e300, 1e300))", r"ratio = \(1e\+300, 1e\+300\) is not"),
        ("RandomResizedCrop(32, ratio=(0.001, 1))", r"ratio = \(0\.001, 1\) is not a range"),
        ("RandomResizedCrop(8, bogus=1)", r"RandomResizedCrop has no argument 'bogus'"),
        ("RandomResizedCrop(8, size=8)", r"got argument 'size' twice"),
        ("CenterCrop(8, 9)", r"CenterCrop takes at most 1 arguments"),
        ("RandomCrop(8, padding=-1)", r"padding = -1 is not a padding"),
        ("RandomCrop(8, pad_if_needed=1)", r"pad_if_needed = 1 is not True or False"),
        ("RandomCrop(8, fill=300)", r"fill = 300 is not a pixel value"),
        ("CenterCrop(8), RandomHorizontalFlip(1.5)", r"p = 1\.5 is not a probability"),
        ("CenterCrop(8), Normalize(0.5, 0)", r"std = 0 is below 1e-06; a std must be at least"),
        ("CenterCrop(8), Normalize(0.5, 1e-45)", r"std = 1e-45 is below 1e-06"),
        ("CenterCrop(8), Normalize(0.5, -1)", r"std = -1 is below 1e-06"),
        (
            "CenterCrop(8), Normalize(3e39, 1)",
            r"mean = 3e\+39 is not one number or three .*float32",
        ),
        ("CenterCrop(8), Normalize(1, 1e39)", r"std = 1e\+39 is not one number or three"),
        (
            "CenterCrop(8), Normalize((0, 1e38, 0), 1e-3)",
            r"Normalize's channel 1 \(mean 1e\+38, std 0\.001\) makes values up to 1e\+41, "
            r"past float32's range .*use a smaller mean or a larger std",
        ),
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


# -- bounds: every intermediate, the number of operations, the text ---------------------------
@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "RandomCrop(8, padding=32768)",
            r"RandomCrop\(8, padding=\(32768, 32768, 32768, 32768\).*\) makes a 69632 x 69632 "
            r"image \(4848615424 pixels, 13\.5 GiB\) from a 4096 x 4096 source, over the limit "
            r"of 67108864 pixels \(192 MiB\) for one intermediate image; use a smaller size or "
            r"padding\.",
        ),
        (
            "Resize(32768), CenterCrop(8)",
            r"Resize\(32768\) makes a 32768 x 32768 image .*3\.0 GiB.*use a smaller size",
        ),
        ("RandomCrop(32768, pad_if_needed=True)", r"makes a 61440 x 61440 image"),
        # pad_if_needed pads a small source most (torchvision adds the shortfall on both sides)
        ("RandomCrop(5000, pad_if_needed=True)", r"makes a 9999 x 9999 image .* from a 1 x 1 "),
        ("CenterCrop(8193)", r"CenterCrop\(8193\) makes a 8193 x 8193 image"),
        ("RandomResizedCrop((16384, 8192))", r"makes a 16384 x 8192 image"),
        ("CenterCrop(64), Resize((8192, 8193)), CenterCrop(8)", r"Resize\(\(8192, 8193\)\)"),
        (
            ", ".join(["Resize((4096, 4096))"] * 80),
            r"augment lists 80 operations, over the 16 allowed; list fewer operations",
        ),
    ],
)
def test_a_chain_whose_intermediate_could_exceed_the_bound_is_refused(text, match):
    with pytest.raises(OptionError, match=match):
        parse_augment(text)
    with pytest.raises(OptionError, match=match):  # the same refusal from the options' check
        check_options({"augment": text})


def test_chains_at_the_bounds_parse():
    assert len(parse_augment(", ".join(["Resize((4096, 4096))"] * MAX_OPS)).ops) == MAX_OPS
    assert parse_augment("CenterCrop(8192)").output_shape == (8192, 8192, 3)
    assert parse_augment("RandomCrop(32, padding=2048)").ops[0].arg("padding") == (2048,) * 4
    spec = parse_augment("RandomResizedCrop(8, scale=(1, 1), ratio=(0.01, 100))")
    assert spec.ops[0].arg("ratio") == (0.01, 100.0)
    norm = parse_augment(f"CenterCrop(8), Normalize(1e30, {MIN_STD})").ops[-1]
    assert norm.arg("std") == (MIN_STD,) * 3


def test_intermediates_walk_names_what_each_op_allocates():
    spec = parse_augment(
        "Resize(10), CenterCrop(12), RandomCrop(8, padding=1), RandomHorizontalFlip(), "
        "RandomResizedCrop((6, 4)), Normalize(0, 1)"
    )
    got = [(op.name, hw) for op, hw in spec.intermediates(20, 40)]
    assert got == [
        ("Resize", (10, 20)),
        ("CenterCrop", (12, 20)),  # pads the height only
        ("RandomCrop", (14, 14)),
        ("RandomHorizontalFlip", (0, 0)),
        ("RandomResizedCrop", (6, 4)),
        ("Normalize", (0, 0)),
    ]
    assert spec.check_source(20, 40) is None
    # a panorama under Resize(int): refused per image, with the op and the size it would reach
    why = parse_augment("Resize(256), CenterCrop(224)").check_source(10, 100_000)
    assert why is not None
    assert why.startswith("Resize(256) makes a 256 x 2560000 image (655360000 pixels, 1.8 GiB)")


@pytest.mark.parametrize(
    "text",
    [
        "CenterCrop(" + "-" * 1500 + "1)",
        "CenterCrop(" + "-" * 1985 + "1)",
        "CenterCrop(" + "(" * 150 + "1" + ",)" * 150 + ")",
        "CenterCrop(" + "[" * 400 + "1" + "]" * 400 + ")",
        "CenterCrop(1), " + "+" * 1900 + "Normalize(0, 1)",
    ],
)
def test_deeply_nested_text_is_refused_as_an_option_error(text):
    with pytest.raises(OptionError, match=r"augment"):
        parse_augment(text)
    with pytest.raises(OptionError, match=r"augment"):
        check_options({"augment": text})


def test_a_parser_that_recurses_too_deeply_is_an_option_error(monkeypatch):
    import ast

    def deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded during ast construction")

    monkeypatch.setattr(ast, "parse", deep)
    with pytest.raises(OptionError, match=r"nests too deeply to be a list of operations, e\.g\."):
        parse_augment("CenterCrop(8)")
