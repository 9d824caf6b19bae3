"""``OpenRequest``: an open's arguments made and checked once, and its one wire encoding, each
field of which is checked on arrival (a malformed one is a ``ServiceError`` naming it)."""

from __future__ import annotations

import importlib.util

import pytest

from tabloader.catalog import LoaderError, OptionError, ServiceError
from tabloader.catalog._options import SPEC_VERSION, JobSpec
from tabloader.engine import Loader
from tabloader.engine._opening import OPEN_VERSION, OpenRequest

STATE = {"epoch": 1, "remaining": b"\x01\x02", "job": "j"}


def wire(**fields):
    """A request's wire form with ``fields`` replaced."""
    return OpenRequest.make("j", rank=0, world_size=1).to_wire() | fields


def test_a_request_comes_back_from_the_wire_as_it_went():
    request = OpenRequest.make(
        "j",
        spec=JobSpec({"batch_size": 8}),
        prefetch=3,
        lookahead=64,
        epochs=2,
        state=STATE,
        rank=1,
        world_size=3,
        image_size=(8, 6),
        seed=5,
        on_error=None,  # not given
    )
    back = OpenRequest.from_wire(request.to_wire())
    assert back == request
    assert back.options == {"image_size": (8, 6), "seed": 5}
    assert back.state == STATE
    assert back.spec == JobSpec({"batch_size": 8})


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, 2], r"not an open request: list"),
        ({"job": "j"}, r"not an open request: \['job'\]"),
        (wire(extra=1), r"not an open request: \[.*'extra'"),
        (wire(v=OPEN_VERSION + 1), rf"of version {OPEN_VERSION + 1}, not {OPEN_VERSION}"),
        (wire(v="1"), r"of version 1, not"),
        (wire(rank="0"), r"rank is 0, not an integer"),
        (wire(rank=True), r"rank is True, not an integer"),
        (wire(world_size=None), r"world_size is None, not an integer"),
        (wire(rank=2, world_size=2), r"rank and world_size"),
        (wire(prefetch="2"), r"prefetch is 2, not an integer or null"),
        (wire(epochs=1.5), r"epochs is 1\.5, not an integer or null"),
        (wire(lookahead=0), r"lookahead 0 is below the range"),
        (wire(job=""), r"non-empty string"),
        (wire(job=7), r"non-empty string, not 7"),
        (wire(options=[["batch_size", 4]]), r"options are \[\['batch_size', 4\]\], not an object"),
        (wire(options={"batch_size": "x"}), r"open\(batch_size='x'\): .*not an integer"),
        (wire(options={"batchsize": 4}), r"Unknown job option 'batchsize'\. Did you mean"),
        (wire(spec={"v": SPEC_VERSION}), r"Not a job spec"),
        (
            wire(spec={"v": SPEC_VERSION, "options": {"seed": -1}}),
            r"A job spec: Job option seed = -1 is out of range",
        ),
        (wire(state={"epoch": 0}), r"Not a job state: KeyError\('remaining'\)"),
        (wire(state={"remaining": "zz"}), r"Not a job state: ValueError"),
    ],
)
def test_a_malformed_request_is_a_service_error_naming_the_field(bad, message):
    with pytest.raises(ServiceError, match=message) as info:
        OpenRequest.from_wire(bad)
    assert "run the same tabloader on both ends" in str(info.value)


def test_the_arguments_are_checked_where_the_request_is_made():
    with pytest.raises(OptionError, match=r"open\(batchsize=4\): Unknown .*'batch_size'\?"):
        OpenRequest.make("j", batchsize=4)
    with pytest.raises(OptionError, match=r"open\(image_size=\(8, 0\)\): .*image_size = 0"):
        OpenRequest.make("j", image_size=(8, 0))
    with pytest.raises(LoaderError, match=r"prefetch 0 is below the range"):
        OpenRequest.make("j", prefetch=0)
    with pytest.raises(LoaderError, match=r"rank=1, world_size=None: pass both"):
        OpenRequest.make("j", rank=1)
    with pytest.raises(LoaderError, match=r"spec= takes a JobSpec, not dict"):
        OpenRequest.make("j", spec={"batch_size": 4})  # type: ignore[arg-type]


def test_each_option_is_checked_alone_and_the_merge_where_the_registered_ones_are():
    # 8000x8000 images are over the batch limit at the default 32 a batch, not at 4
    request = OpenRequest.make("j", image_size=8000)
    assert request.resolve_spec({"batch_size": 4}).values == {"batch_size": 4, "image_size": 8000}
    with pytest.raises(OptionError, match=r"open\(image_size=8000\): .*over the 4 GiB limit"):
        request.resolve_spec({"batch_size": 32})
    # augment given replaces a registered image_size; a whole spec is the registered options
    crop = OpenRequest.make("j", augment="RandomResizedCrop(8)")
    assert "image_size" not in crop.resolve_spec({"image_size": 16}).values
    spec = JobSpec({"batch_size": 2})
    assert OpenRequest.make("j", spec=spec).resolve_spec({"batch_size": 9}) is spec
    over = OpenRequest.make("j", spec=spec, seed=1).resolve_spec({"batch_size": 9})
    assert over.values == {"batch_size": 2, "seed": 1}


def test_ranks_are_those_of_the_process_that_resolves_the_request(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    request = OpenRequest.make("j")
    assert (request.rank, request.world_size) == (None, None)  # not yet: at the open
    assert (request.resolved().rank, request.resolved().world_size) == (1, 2)
    assert (request.to_wire()["rank"], request.to_wire()["world_size"]) == (1, 2)
    given = OpenRequest.make("j", rank=0, world_size=1)
    assert given.resolved() is given


def test_a_loader_takes_the_request_whole(images):
    images.sql("REGISTER JOB j SELECT label FROM imgs WITH (batch_size = 3)")
    with Loader(images, cache_bytes=1 << 20) as loader:
        request = OpenRequest.make("j", batch_size=5, epochs=1, rank=0, world_size=1)
        with pytest.raises(LoaderError, match=r"open\(OpenRequest, epochs=\.\.\.\): the request"):
            loader.open(request, epochs=2)
        with loader.open(request) as stream:
            assert stream.spec.batch_size == 5
            assert stream.epochs == 1
            assert len(stream.next_batch()["_id"]) == 5


# -- a resume state and a rank count are bounded where the request is made ------------------
@pytest.mark.parametrize(
    ("epoch", "epochs"),
    [
        *[(-5, None), (2**62, None), (10**18, None), (2**70, None), (1e300, None)],
        *[(True, None), (3.0, None), ("3", None), (2**31, None), (5, 4)],
    ],
)
def test_a_state_whose_epoch_is_no_epoch_is_refused_at_once(epoch, epochs):
    state = {**STATE, "epoch": epoch}
    with pytest.raises(LoaderError, match=r"The state's epoch .* is not an epoch from 0 to"):
        OpenRequest.make("j", state=state, epochs=epochs)
    with pytest.raises(ServiceError, match=r"malformed open request \(The state's epoch"):
        OpenRequest.from_wire(
            wire(state={**STATE, "remaining": "0102", "epoch": epoch}, epochs=epochs)
        )


def test_a_state_at_its_last_epoch_or_without_epochs_is_taken():
    assert OpenRequest.make("j", state={**STATE, "epoch": 4}, epochs=4).state["epoch"] == 4
    assert OpenRequest.make("j", state={**STATE, "epoch": 2**31 - 1}).state is not None


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([1], r"Not a job state: a list"),
        ({"epoch": 0, "remaining": b""}, r"Not a job state: KeyError\('job'\)"),
        ({**STATE, "remaining": [1, 2]}, r"'remaining' is a list, not bytes"),
        ({**STATE, "importance": {"ids": "00"}}, r"'importance' is .*, not scores'"),
    ],
)
def test_a_state_of_another_form_is_refused_naming_the_field(state, message):
    with pytest.raises(LoaderError, match=message):
        OpenRequest.make("j", state=state)


@pytest.mark.parametrize("world_size", [4097, 10**6, 2**70])
def test_a_world_size_over_the_most_ranks_is_refused(world_size):
    with pytest.raises(LoaderError, match=r"world_size <= 4096 \(the most ranks a job has\)"):
        OpenRequest.make("j", rank=0, world_size=world_size)
    with pytest.raises(ServiceError, match=r"malformed open request \(.*world_size <= 4096"):
        OpenRequest.from_wire(wire(world_size=world_size))


def test_a_state_or_world_is_checked_against_the_jobs_rows(images):
    """Sizes a state names are checked against the job's rows before an array is made of
    them: a bitmap of 2**32 rows, importance scores of 2**20 rows (230 bytes) or of 2**27."""
    from pyroaring import BitMap

    images.sql("REGISTER JOB j SELECT label FROM imgs WITH (importance = 'loss')")
    every = BitMap()
    every.add_range(0, 1 << 32)
    every.run_optimize()  # a few bytes
    with Loader(images, cache_bytes=1 << 20) as loader:
        with loader.open("j", batch_size=4) as stream:
            stream.next_batch()
            state = stream.state_dict()
        forged = {**state, "remaining": every.serialize()}
        with pytest.raises(LoaderError, match=r"not a non-empty subset of job 'j'"):
            loader.open("j", state=forged)
        for rows, message in [
            (1 << 20, r"it names 1048576 rows, not the job's 60"),
            (1 << 27, r"its ids take 28932 bytes, more than 60 rows do"),
        ]:
            many = BitMap()
            many.add_range(0, rows)
            many.run_optimize()
            forged = {**state, "importance": {**state["importance"], "ids": many.serialize()}}
            with pytest.raises(LoaderError, match=message):
                loader.open("j", state=forged)
        with pytest.raises(LoaderError, match=r"world_size=61: job 'j' has 60 rows, fewer"):
            loader.open("j", rank=0, world_size=61, drop_last=False)
        with loader.open("j", state=state) as again:  # the true state still resumes
            assert again.next_batch() is not None


def test_the_three_doors_take_the_typed_open_arguments():
    """``Loader.open``, ``RemoteLoader.open`` and ``JobDataset`` take ``**args:
    Unpack[OpenArgs]`` (mypy and editors see ``batch_size=``), and ``OpenArgs`` names every
    argument of an ``OpenRequest`` beside the job: the job options and the open's own."""
    import dataclasses
    import inspect

    from tabloader.catalog._options import JOB_OPTIONS
    from tabloader.engine import OpenArgs
    from tabloader.service._client import RemoteLoader

    doors = [Loader.open, Loader.serve, RemoteLoader.open]
    if importlib.util.find_spec("torch") is not None:
        from tabloader.torch import JobDataset

        doors.append(JobDataset.__init__)
    for door in doors:
        args = inspect.signature(door).parameters["args"]
        assert args.kind is args.VAR_KEYWORD, door
        assert args.annotation == "Unpack[OpenArgs]", door
    own = {f.name for f in dataclasses.fields(OpenRequest)} - {"job", "options"}
    assert set(OpenArgs.__annotations__) == set(JOB_OPTIONS) | own
