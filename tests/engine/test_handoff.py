"""One handed-over batch: its wire encoding round-trips, a malformed one is refused, and a job
gets the same batches in this process as from the loader service."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tabloader import catalog
from tabloader.catalog._errors import ServiceError
from tabloader.engine import Loader
from tabloader.engine._arena.shm import shm_available
from tabloader.engine._deliver.batchmem import BatchMemory
from tabloader.engine._deliver.handoff import (
    Arrow,
    Augmented,
    HandedBatch,
    Held,
    ImageList,
    Images,
    Raw,
    Staging,
)

BASE = 1 << 16  # where the staging is placed in the test's memory
RNG = np.random.default_rng(7)


def _memory() -> np.ndarray:
    return RNG.integers(0, 256, 1 << 18, dtype=np.uint8)


def _batch(memory: np.ndarray) -> HandedBatch:
    """A batch of 3 rows of every kind that travels: values in ``memory`` below ``BASE``,
    and one of each prepared column in ``private`` (the arena had no room for it)."""
    ids = np.array([5, 9, 2], np.int64)
    images = Images("img", np.array([0, -1, 4096], np.int64), (8, 8, 3), {1: _image(8, 8)})
    shapes = np.array([[4, 6, 3], [5, 5, 0], [2, 3, 3]], np.int32)
    varied = ImageList("var", np.array([8192, -1, 9000], np.int64), shapes, {1: _image(5, 5)})
    augmented = Augmented(
        "aug",
        np.array([-1, 12288, 16384], np.int64),
        (4, 4, 3),
        {0: RNG.random((4, 4, 3), np.float32)},
        dtype=np.dtype(np.float32),
    )
    columns = [
        Held("_id", ids),
        Held("label", np.array([[1, 2], [3, 4], [5, 6]], np.int16)),
        Held("path", ["a.jpg", None, "ccc.jpg"]),
        images,
        varied,
        augmented,
    ]
    return HandedBatch(columns, 3)


def _image(h: int, w: int) -> np.ndarray:
    return RNG.integers(0, 256, (h, w, 3) if w != 5 else (h, w), dtype=np.uint8)


def _wire(batch: HandedBatch, memory: np.ndarray) -> dict:
    staging = Staging()
    wire = batch.to_wire(staging)
    staging.write(memory[BASE:], BASE)
    wire["base"] = BASE
    return wire


def _equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name in a:
        if isinstance(a[name], list):
            assert len(a[name]) == len(b[name])
            for x, y in zip(a[name], b[name], strict=True):
                np.testing.assert_array_equal(x, y)
                assert type(x) is type(y)
        else:
            np.testing.assert_array_equal(a[name], b[name])
            assert a[name].dtype == b[name].dtype


def test_the_wire_encoding_round_trips():
    memory = _memory()
    batch = _batch(memory)
    here = batch.copy_out(memory, BatchMemory())  # as a job of the engine's process gets it
    read = HandedBatch.from_wire(_wire(batch, memory), memory)
    assert len(read) == 3
    kinds = [type(c) for c in read.columns]
    assert kinds == [Raw, Raw, Arrow, Images, ImageList, Augmented]
    there = read.copy_out(memory, BatchMemory())
    _equal(there, here)
    assert there["path"] == ["a.jpg", None, "ccc.jpg"]
    np.testing.assert_array_equal(here["img"][1], batch.columns[3].private[1])
    assert here["var"][1].shape == (5, 5)  # 0 channels: grey
    # counted as a client counts its copies: the images, their bytes, the service's staged
    assert read.images() == (9, 3 * 192 + (72 + 25 + 18) + 3 * 192, 192 + 25 + 192)


def test_an_empty_batch_round_trips():
    memory = _memory()
    empty = np.zeros((0, 3), np.int32)
    columns = [
        Held("_id", np.zeros(0, np.int64)),
        ImageList("img", np.zeros(0, np.int64), empty, {}),
    ]
    staging = Staging()
    wire = HandedBatch(columns, 0).to_wire(staging)
    assert staging.used == 0  # nothing to place: the service sends base -1
    read = HandedBatch.from_wire(wire, memory)
    out = read.copy_out(memory, BatchMemory())
    assert out["_id"].shape == (0,)
    assert out["img"] == []


def _mangled(change) -> tuple[dict, np.ndarray]:
    memory = _memory()
    wire = _wire(_batch(memory), memory)
    change(wire)
    return wire, memory


def _column(wire: dict, name: str) -> dict:
    return next(c for c in wire["columns"] if c["name"] == name)


def _index_at(wire: dict, memory: np.ndarray, name: str, width: int) -> np.ndarray:
    col = _column(wire, name)
    start = wire["base"] + col["index"]
    return memory[start : start + col["rows"] * width * 8].view(np.int64).reshape(-1, width)


MALFORMED = {
    "not a dict": (lambda w: w.clear(), r"not a batch layout"),
    "another version": (lambda w: w.update(v=2), r"a batch layout of version 2, not 1"),
    "a bool version": (lambda w: w.update(v=True), r"version True"),
    "no columns": (lambda w: w.update(columns=[]), r"base .* and columns"),
    "a string base": (lambda w: w.update(base="0"), r"base 0 and columns"),
    "an unknown kind": (lambda w: _column(w, "img").update(kind="video"), r"a column .*video"),
    "a column not a dict": (lambda w: w["columns"].append(3), r"a column 3"),
    "no name": (lambda w: _column(w, "img").pop("name"), r"a column "),
    "a negative offset": (
        lambda w: _column(w, "label").update(offset=-8),
        r"column 'label''s 'offset' is -8",
    ),
    "an offset past the memory": (
        lambda w: _column(w, "label").update(offset=1 << 20),
        r"column 'label': 12 bytes at \d+, outside the 262144 bytes of shared memory",
    ),
    "a bad dtype": (
        lambda w: _column(w, "label").update(dtype="not-a-dtype"),
        r"column 'label''s dtype is not-a-dtype",
    ),
    "an object dtype": (lambda w: _column(w, "aug").update(dtype="|O"), r"'aug''s dtype is \|O"),
    "a bad shape": (lambda w: _column(w, "img").update(shape=[8, "8"]), r"'img''s shape is"),
    "too many rows": (
        lambda w: _column(w, "img").update(rows=1 << 40),
        r"column 'img': \d+ bytes at \d+, outside",
    ),
    "no staged_bytes": (lambda w: _column(w, "aug").pop("staged_bytes"), r"'staged_bytes' is None"),
    "an arrow size past the memory": (
        lambda w: _column(w, "path").update(size=1 << 20),
        r"column 'path': 1048576 bytes",
    ),
    "ids not first": (lambda w: w["columns"].reverse(), r"first column is not the _id array"),
    # each of these raised a raw TypeError, OverflowError, ValueError or MemoryError before
    "a zero-size dtype of any shape": (
        lambda w: _column(w, "label").update(dtype="V0", shape=[3, 1 << 40]),
        r"'label''s dtype V0 has 0 B",
    ),
    "a sub-array dtype": (lambda w: _column(w, "aug").update(dtype="(2,)<f4"), r"dtype is \(2"),
    "a structured dtype": (lambda w: _column(w, "label").update(dtype="i2,i2"), r"dtype is i2"),
    "a dtype numpy cannot parse": (
        lambda w: _column(w, "label").update(dtype="(2**20,)u1"),
        r"'label''s dtype is \(2\*\*20",
    ),
    "a huge base": (lambda w: w.update(base=2**70), r"bytes at \d+, outside"),
    "a huge image": (
        lambda w: _column(w, "aug").update(shape=[2**40, 2**40, 3]),
        r"'aug''s shape is \[1099511627776",
    ),
    "an empty shape of a huge size": (
        lambda w: _column(w, "label").update(shape=[3, 0, 2**62]),
        r"'label''s shape is \[3, 0, 4611686018427387904\]",
    ),
    "a scalar column": (lambda w: _column(w, "label").update(shape=[]), r"'label' has -1 rows"),
    "fewer rows than the ids": (
        lambda w: _column(w, "img").update(rows=2),
        r"column 'img' has 2 rows, not 3",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_batch_is_a_service_error(case):
    change, message = MALFORMED[case]
    wire, memory = _mangled(change)
    with pytest.raises(ServiceError, match=r"malformed batch \(.*" + message):
        HandedBatch.from_wire(wire, memory)


@pytest.mark.parametrize(("name", "width", "value"), [("img", 1, 1 << 30), ("var", 4, -5)])
def test_an_image_outside_the_memory_is_a_service_error(name, width, value):
    """The indexes in shared memory are checked too: a start past the mapping, or a
    negative one, is refused before any copy."""
    memory = _memory()
    wire = _wire(_batch(memory), memory)
    _index_at(wire, memory, name, width)[2, 0] = value
    with pytest.raises(ServiceError, match=rf"column '{name}' has values outside shared memory"):
        HandedBatch.from_wire(wire, memory)


def test_a_negative_image_shape_is_a_service_error():
    memory = _memory()
    wire = _wire(_batch(memory), memory)
    _index_at(wire, memory, "var", 4)[0, 1] = -4
    with pytest.raises(ServiceError, match=r"column 'var' has image shapes out of range"):
        HandedBatch.from_wire(wire, memory)


def test_a_mangled_arrow_stream_is_a_service_error():
    memory = _memory()
    wire = _wire(_batch(memory), memory)
    col = _column(wire, "path")
    memory[BASE + col["offset"] : BASE + col["offset"] + col["size"]] = 0xFF
    read = HandedBatch.from_wire(wire, memory)
    with pytest.raises(ServiceError, match=r"column 'path' is no Arrow stream"):
        read.copy_out(memory, BatchMemory())


def test_an_arrow_stream_of_bad_strings_is_a_service_error():
    """Bytes that are no UTF-8 where strings are: pyarrow's reader takes them (and offsets
    past its buffers, which crashed the process), its full validation does not."""
    memory = _memory()
    batch = _batch(memory)
    batch.columns[2] = Held("path", ["a\u00e9.jpg", "b.jpg", "c.jpg"])
    wire = _wire(batch, memory)
    col = _column(wire, "path")
    at = BASE + col["offset"]
    data = memory[at : at + col["size"]]
    found = bytes(data).find("\u00e9".encode())
    data[found] = 0xFF
    read = HandedBatch.from_wire(wire, memory)
    with pytest.raises(ServiceError, match=r"column 'path' is no Arrow stream: .*UTF8"):
        read.copy_out(memory, BatchMemory())


def test_a_fuzzed_layout_is_a_service_error_or_a_whole_batch():
    """Any field of a true layout, or a few of its staged index values, replaced by values
    of every type and range: each read is a ServiceError or a batch whose every column has
    the batch's rows (4% raised raw errors, a few a 96 GiB MemoryError, one crashed)."""
    rng = np.random.default_rng(45)
    values = [-1, 0, 7, 2**31, 2**40, 2**63, 2**70, 1.5, 1e300, True, None, "8", [], {}, [1]]
    dtypes = ["V0", "S0", "<U4", "|O", "<f8", "m8", "(2,)i4", "i4,i4", "", "z", "<c16"]
    shapes = [[], [0], [-1], [2**40, 2**40], [3, 0, 2**62], [1.5], ["3"], [3, [1]], [3]]
    fields = ["offset", "dtype", "shape", "size", "rows", "index", "staged_bytes", "kind"]
    outcomes = {"error": 0, "batch": 0}
    for _ in range(400):
        memory = _memory()
        wire = _wire(_batch(memory), memory)
        for _ in range(rng.integers(1, 3)):
            col = wire["columns"][rng.integers(len(wire["columns"]))]
            key = fields[rng.integers(len(fields))]
            pool = {"dtype": dtypes + values, "shape": shapes + values}.get(key, values)
            col[key] = pool[rng.integers(len(pool))]
        if rng.random() < 0.3:  # index values in staging
            at = BASE + 8 * rng.integers(0, 200, 4)
            memory.view(np.int64)[at // 8] = rng.choice([-1, 5, 2**40, 2**62, -(2**62)], 4)
        try:
            out = HandedBatch.from_wire(wire, memory).copy_out(memory, BatchMemory())
        except ServiceError:
            outcomes["error"] += 1
        else:
            outcomes["batch"] += 1
            assert {len(v) for v in out.values()} == {len(out["_id"])}
    assert outcomes["error"] > 200  # most mangled fields are caught (some are harmless)


# -- the same job, in this process and through the service --------------------------------------
AUGMENT = "RandomResizedCrop(12, scale=(0.3, 1.0)), RandomHorizontalFlip()"


def _epochs(stream, epochs: int = 2) -> list[list[dict]]:
    out = []
    for _ in range(epochs):
        out.append([{k: np.copy(v) for k, v in b.items()} for b in stream.iter_epoch()])
    return out


@pytest.mark.skipif(not shm_available(), reason="no /dev/shm (O_TMPFILE) on this system")
@pytest.mark.parametrize("job", ["plain", "augmented", "weighted"])
def test_a_job_gets_the_same_batches_in_process_and_from_the_service(image_cat_dir, job):
    from tabloader.service._client import RemoteLoader
    from tabloader.service._server import Service

    root = image_cat_dir
    options = {
        "plain": "image_size = 16",
        "augmented": f"augment = '{AUGMENT}'",
        "weighted": "image_size = 16, weight = 'label + 1'",  # batches carry ``_weight``
    }[job]
    with catalog.open_catalog(root) as cat:
        cat.sql(f"REGISTER JOB {job} SELECT image, label FROM imgs WITH ({options})")
    with (
        Loader(root, workers=2, cache_bytes=32 << 20) as loader,
        loader.open(job, batch_size=8, epochs=2) as stream,
    ):
        here = _epochs(stream)
    service = Service(root, cache_bytes=32 << 20, workers=2)
    runner = threading.Thread(target=service.serve, daemon=True)
    runner.start()
    try:
        with (
            RemoteLoader(root, start=False) as remote,
            remote.open(job, batch_size=8, epochs=2) as s,
        ):
            there = _epochs(s)
    finally:
        service.stop()
        runner.join(60)
    assert not runner.is_alive()
    assert sum(len(b["_id"]) for b in here[0]) == 60
    assert len(here) == len(there) == 2
    for mine, theirs in zip(here, there, strict=True):
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            _equal(a, b)  # the same ids in the same order, the same pixels and labels
    assert here[0][0]["image"].shape[1:] == ((12, 12, 3) if job == "augmented" else (16, 16, 3))
    assert ("_weight" in here[0][0]) == (job == "weighted")
    if job == "weighted":  # 1 / (N p_row), p_row = (label + 1) / sum(label + 1): mean 1
        batch = here[0][0]
        assert list(batch)[:2] == ["_id", "_weight"]
        assert batch["_weight"].dtype == np.float32
        scaled = batch["_weight"] * (batch["label"] + 1.0)  # sum(label + 1) / N for every row
        assert np.allclose(scaled, scaled[0], rtol=1e-6)
