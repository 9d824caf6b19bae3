"""Job options: one declared table, checked at REGISTER, stored typed."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pytest

from tabloader import catalog
from tabloader.catalog import JobOptions, OptionError, StatementError
from tabloader.catalog._options import (
    BATCH_BYTES_LIMIT,
    JOB_OPTIONS,
    SPEC_VERSION,
    JobOption,
    JobSpec,
    check_options,
    option_value,
)


@pytest.fixture(scope="module")
def table_t(tmp_path_factory):
    """A closed catalog holding dataset ``t``, imported once: each test opens a copy."""
    root = tmp_path_factory.mktemp("options") / "cat"
    with catalog.open_catalog(root) as c:
        c.import_arrow("t", pa.table({"x": list(range(100))}))
    return root


@pytest.fixture
def cat(tmp_path, table_t):
    shutil.copytree(table_t, tmp_path / "cat", copy_function=shutil.copy)
    with catalog.open_catalog(tmp_path / "cat") as c:
        yield c


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("batch_size = -3", r"batch_size = -3 is out of range; .* from 1 to 65536, e\.g\. WITH"),
        ("batch_size = 0", r"batch_size = 0 is out of range; .*WITH \(batch_size = 32\)"),
        ("batch_size = 'abc'", r"batch_size = 'abc' is not an integer; rows per batch is a whole"),
        ("batch_size = 2.5", "batch_size = 2.5 is not an integer"),
        ("batch_size = TRUE", "batch_size = TRUE is not an integer"),
        ("image_size = 0", r"image_size = 0 is out of range; .*WITH \(image_size = 224\)"),
        ("image_size = -1", "image_size = -1 is out of range"),
        ("batchsize = 32", r"Unknown job option 'batchsize'\. Did you mean 'batch_size'\?"),
        ("lr = 0.1", r"Unknown job option 'lr'\. Job options: batch_size, image_size, seed"),
        ("on_error = 'ignore'", r"on_error = 'ignore' is not one of 'raise', 'skip'"),
        ("seed = -1", "seed = -1 is out of range"),
        (
            "image_size = 100000",
            r"image_size = 100000 is out of range; .* from 1 to 32768",
        ),
        (
            "image_size = 20000",
            r"image_size = 20000 makes one batch of 32 images 35\.8 GiB .*over the 4 GiB "
            r"limit for one batch; use image_size <= 6688 with batch_size = 32",
        ),
        (
            "batch_size = 4096, image_size = 1024",
            r"over the 4 GiB limit for one batch; use image_size <= 591 with batch_size = 4096",
        ),
    ],
)
def test_bad_options_are_refused_at_register(cat, options, message):
    with pytest.raises(OptionError, match=message) as info:
        cat.sql(f"REGISTER JOB j SELECT x FROM t WITH ({options})")
    assert isinstance(info.value, StatementError)
    assert "\n" not in str(info.value)
    assert cat.job_names() == []


def test_the_python_api_checks_options_too(cat):
    with pytest.raises(OptionError, match="Did you mean 'image_size'"):
        cat.register_job("j", "t", options={"imagesize": 64})
    job = cat.register_job("j", "t", options={"batch_size": 16})
    assert job.options == {"batch_size": 16}


def test_options_are_stored_typed(cat):
    cat.sql("REGISTER JOB j SELECT x FROM t WITH (batch_size = 16, image_size = 32, seed = 7)")
    stored = cat.connection.execute("SELECT options FROM _tabloader.jobs").fetchone()[0]
    assert json.loads(stored) == {"batch_size": 16, "image_size": 32, "seed": 7}
    assert all(type(v) is int for v in cat.job("j").options.values())


def test_the_loader_reads_defaults_from_the_table():
    assert option_value({}, "batch_size") == JOB_OPTIONS["batch_size"].default == 32
    assert option_value({}, "image_size") is None
    assert option_value({"on_error": "skip"}, "on_error") == "skip"
    with pytest.raises(OptionError, match="batch_size = 'abc'"):  # a job of an older tabloader
        option_value({"batch_size": "abc"}, "batch_size")


def test_a_batch_at_the_limit_is_accepted():
    side = 6688  # the largest side the message above offers for batch_size 32
    assert 32 * side * side * 3 <= BATCH_BYTES_LIMIT < 32 * (side + 1) ** 2 * 3
    assert check_options({"image_size": side}) == {"image_size": side}
    with pytest.raises(OptionError, match="image_size <= 6688"):
        check_options({"image_size": side + 1})


def test_open_cannot_ask_for_what_register_refuses():
    stored = check_options({"batch_size": 65536})
    assert JobSpec.from_options(stored, image_size=None).values == {"batch_size": 65536}
    spec = JobSpec.from_options(stored, batch_size=8, image_size=(20, 30))
    assert spec.values == {"batch_size": 8, "image_size": (20, 30)}
    assert (spec.batch_size, spec.image_size, spec.on_error) == (8, (20, 30), "raise")
    with pytest.raises(OptionError, match=r"open\(image_size=512\): .* 48\.0 GiB .* <= 147"):
        JobSpec.from_options(stored, image_size=512)
    with pytest.raises(OptionError, match=r"image_size = \(2000, 3000\) makes one batch"):
        JobSpec.from_options({}, batch_size=256, image_size=(2000, 3000))  # each side in range
    with pytest.raises(OptionError, match=r"open\(image_size=\(0, 5\)\): .* out of range"):
        JobSpec.from_options({}, image_size=(0, 5))
    with pytest.raises(OptionError, match=r"open\(batchsize=8\): .*Did you mean 'batch_size'"):
        JobSpec.from_options(stored, batchsize=8)
    with pytest.raises(OptionError, match="augment and image_size are both set"):
        JobSpec({"augment": "CenterCrop(8)", "image_size": (8, 8)})


def test_an_open_replaces_augment_with_image_size_and_the_other_way_round():
    stored = {"augment": "CenterCrop(8)", "seed": 3}
    assert JobSpec.from_options(stored, image_size=16).values == {"seed": 3, "image_size": 16}
    spec = JobSpec.from_options({"image_size": 16}, augment="CenterCrop(8)")
    assert spec.values == {"augment": "CenterCrop(8)"}


def test_the_spec_has_every_option_of_the_table_and_its_defaults():
    spec = JobSpec()
    assert spec.resolved() == {name: o.default for name, o in JOB_OPTIONS.items()}
    assert not set(JOB_OPTIONS) & set(dir(JobSpec))  # no option hides behind a method
    with pytest.raises(AttributeError, match="JobSpec has no option 'batchsize'"):
        spec.batchsize  # noqa: B018


@pytest.mark.parametrize(
    "stored",
    [
        {},
        {"batch_size": 7, "image_size": (20, 30), "on_error": "skip", "seed": 2**63 - 1},
        {"augment": "RandomResizedCrop(64), RandomHorizontalFlip()", "decode_size": 80},
    ],
)
def test_the_spec_goes_over_the_wire_and_back(stored):
    spec = JobSpec(stored)
    wire = spec.to_wire()
    assert json.loads(json.dumps(wire)) == wire  # JSON values only
    assert wire["v"] == SPEC_VERSION
    back = JobSpec.from_wire(json.loads(json.dumps(wire)))
    assert back == spec
    assert back.resolved() == spec.resolved()


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        ({"v": SPEC_VERSION + 1, "options": {}}, r"version 2; this tabloader reads version 1: "),
        ({"v": "1", "options": {}}, r"version '1'; this tabloader reads version 1"),
        ({"options": {}}, r"Not a job spec: .*; send JobSpec\.to_wire\(\)'s"),
        ({"v": 1, "options": {}, "x": 1}, "Not a job spec"),
        ([1], "Not a job spec"),
        ({"v": 1, "options": [1]}, "A job spec's options are list, not a dict"),
        (
            {"v": 1, "options": {"batchsize": 8}},
            r"A job spec: Unknown job option 'batchsize'\. Did you mean 'batch_size'",
        ),
        ({"v": 1, "options": {"batch_size": "8"}}, "batch_size = '8' is not an integer"),
        ({"v": 1, "options": {"image_size": [0, 5]}}, "image_size = 0 is out of range"),
    ],
)
def test_a_wire_spec_of_another_form_or_version_is_refused(wire, message):
    with pytest.raises(OptionError, match=message):
        JobSpec.from_wire(wire)


def test_an_option_added_to_the_table_is_carried_as_it_is(monkeypatch):
    row = JobOption("momentum", int, 9, "a test option", minimum=0, maximum=99, example=9)
    monkeypatch.setitem(JOB_OPTIONS, "momentum", row)
    assert JobSpec().momentum == 9
    spec = JobSpec.from_options({"momentum": 5}, batch_size=4)
    assert (spec.momentum, JobSpec.from_wire(spec.to_wire()).momentum) == (5, 5)
    assert JobSpec.from_options({"momentum": 5}, momentum=6).momentum == 6
    with pytest.raises(OptionError, match=r"open\(momentum=100\): .* from 0 to 99"):
        JobSpec.from_options({}, momentum=100)


def test_every_option_is_typed_for_mypy_on_job_spec_and_the_doors():
    """``JobSpec``'s ``if TYPE_CHECKING`` block types each option of the table (mypy then
    refuses a misspelt ``spec.batch_sise``), and so does ``JobOptions``, the keyword
    arguments of the three doors (``Loader.open``, ``RemoteLoader.open``, ``JobDataset``: an
    editor shows ``batch_size=``); a row added to ``JOB_OPTIONS`` needs its line in both."""
    import ast
    import inspect

    import tabloader.catalog._options as options_module

    tree = ast.parse(inspect.getsource(options_module))
    spec = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "JobSpec")
    typed = {
        stmt.target.id
        for block in spec.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for stmt in block.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }
    assert typed == set(JOB_OPTIONS)
    assert set(JobOptions.__annotations__) == set(JOB_OPTIONS)
    assert not JobOptions.__required_keys__  # every option may be left out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("importance = 'gradient'", r"importance = 'gradient' is not one of 'loss'"),
        ("weight = ''", r"weight = '' is not a SQL expression of 1 to 4096 characters"),
        ("weight = 3", r"weight = 3 is not a SQL expression of 1 to 4096 characters"),
        ("replacement = 'maybe'", r"replacement = 'maybe' is not TRUE or FALSE"),
        (
            "weight = 'x', importance = 'loss'",
            r"weight and importance are both set: .*; drop one of them\.",
        ),
        (
            "replacement = FALSE",
            r"replacement = FALSE is set on a job without weight or importance: .* drop "
            r"replacement, or set weight",
        ),
        ("replacement = TRUE", r"replacement = TRUE is set on a job without weight"),
    ],
)
def test_bad_weighting_options_are_refused_at_register(cat, options, message):
    with pytest.raises(OptionError, match=message) as info:
        cat.sql(f"REGISTER JOB j SELECT x FROM t WITH ({options})")
    assert "\n" not in str(info.value)
    assert cat.job_names() == []


def test_weighting_options_are_stored_and_typed(cat):
    cat.sql("REGISTER JOB i SELECT x FROM t WITH (importance = 'LOSS', replacement = FALSE)")
    spec = JobSpec(cat.job("i").options)
    assert (spec.importance, spec.replacement, spec.weight) == ("loss", False, None)
    cat.sql("REGISTER JOB w SELECT x FROM t WITH (weight = 'x + 1')")
    spec = JobSpec(cat.job("w").options)
    assert (spec.weight, spec.replacement, spec.importance) == ("x + 1", True, None)
    assert JobSpec.from_wire(spec.to_wire()) == spec


def test_an_open_may_not_change_the_weight_expression():
    stored = {"weight": "x + 1"}
    assert JobSpec.from_options(stored, weight="x + 1", replacement=False).replacement is False
    with pytest.raises(OptionError, match=r"open\(weight='x'\): .* evaluated at REGISTER"):
        JobSpec.from_options(stored, weight="x")
    with pytest.raises(OptionError, match=r"open\(importance='loss'\): .*both set"):
        JobSpec.from_options(stored, importance="loss")
