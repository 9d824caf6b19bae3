"""The stream protocol: the in-process and the service's streams offer the same members, with
signatures that take every call the protocol allows; the calls only a server makes live on
``ServedStream`` (what ``Loader.serve`` opens)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from tabloader.catalog._errors import LoaderError
from tabloader.engine import Loader
from tabloader.engine._deliver.stream import JobStream, ServedStream
from tabloader.engine._deliver.streams import Stream
from tabloader.engine._queue.sources import Fed
from tabloader.service._client import RemoteStream

SERVER_ONLY = ("feed", "fail", "lost", "share_done", "wants_rows", "record_stalls")


def members() -> list[str]:
    return sorted(
        n
        for n, v in vars(Stream).items()
        if (callable(v) or isinstance(v, property)) and (not n.startswith("_") or n in DUNDERS)
    )


DUNDERS = ("__iter__", "__enter__", "__exit__")


def set_in_init(cls: type) -> set[str]:
    """The attributes ``cls.__init__`` sets on ``self`` (from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {
        node.attr
        for assign in ast.walk(tree)
        if isinstance(assign, (ast.Assign, ast.AnnAssign))
        for target in (assign.targets if isinstance(assign, ast.Assign) else [assign.target])
        for node in ast.walk(target)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


@pytest.mark.parametrize("cls", [JobStream, RemoteStream])
def test_both_streams_take_every_call_of_the_protocol(cls):
    attributes = set_in_init(cls)
    for name in members():
        want = vars(Stream)[name]
        if isinstance(want, property):  # a property, or an attribute set in __init__
            assert isinstance(getattr(cls, name, None), property) or name in attributes, name
            continue
        have = inspect.signature(getattr(cls, name))
        for p in inspect.signature(want).parameters.values():
            if p.kind is p.VAR_POSITIONAL:
                assert any(q.kind is q.VAR_POSITIONAL for q in have.parameters.values()), name
            else:
                assert p.name in have.parameters, f"{cls.__name__}.{name} lacks {p.name}"
                assert have.parameters[p.name].kind == p.kind, f"{cls.__name__}.{name}({p.name})"


def test_the_protocol_names_what_consumers_use():
    assert set(members()) >= {
        "name",
        "rank",
        "world_size",
        "spec",
        "epoch",
        "take",
        "iter_epoch",
        "next_batch",
        "state_dict",
        "abandon",
        "stats",
        "close",
        *DUNDERS,
    }
    assert not set(SERVER_ONLY) & set(members())


@pytest.fixture
def loader(cat):
    cat.import_arrow("t", pa.table({"x": np.arange(20)}))
    cat.register_job("j", "t")
    with Loader(cat, workers=1, decode="threads") as eng:
        yield eng


def test_a_local_open_is_a_stream_without_the_servers_calls(loader):
    with loader.open("j", batch_size=4) as stream:
        assert isinstance(stream, Stream)
        assert not any(hasattr(stream, n) for n in SERVER_ONLY)
        assert not isinstance(stream, ServedStream)
        assert len(next(iter(stream))["_id"]) == 4


def test_a_fed_open_is_a_served_stream(loader):
    with loader.serve("j", source=Fed, receiver=loader.collate, batch_size=4) as stream:
        assert isinstance(stream, ServedStream)
        assert isinstance(stream, Stream)
        stream.feed(0, np.arange(8, dtype=np.int64), np.arange(8, dtype=np.int64))
        assert stream.take()["_id"].tolist() == [0, 1, 2, 3]


def test_a_served_stream_of_a_sampled_job_refuses_rows_fed(loader):
    """The row source is chosen at the open: rows fed to a job this loader samples are an
    error naming the fix, never rows queued beside its sampler's."""
    with loader.serve("j", receiver=loader.collate, batch_size=4) as stream:
        with pytest.raises(LoaderError, match="is sampled by this loader: its rows come from"):
            stream.feed(0, np.arange(4, dtype=np.int64), np.arange(4, dtype=np.int64))
        with pytest.raises(LoaderError, match="has no leader to fail it"):
            stream.fail("gone")
        assert len(stream.take()["_id"]) == 4
