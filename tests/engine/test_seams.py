"""The seams a new store or decode backend plugs into, used here by registering only: no
engine module knows of the in-memory store or the backends below."""

from __future__ import annotations

import io
import json
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tabloader.engine.decode._images as codec
from tabloader import catalog
from tabloader.catalog._errors import CatalogError, LoaderError, StorageError
from tabloader.catalog._settings import STORAGE_ENV
from tabloader.catalog.storage import DatasetReader, open_store, register_store, unregister_store
from tabloader.engine import Loader, decode
from tabloader.engine._arena.shm import shm_available
from tabloader.engine._prepare import prep
from tabloader.engine._prepare.decoding import decode_rows, reader_of
from tabloader.engine._prepare.prep import DecodeKind, Decoder, decoder_for
from tabloader.engine.decode import (
    PillowBackend,
    decode_image,
    register_decode_backend,
    unregister_decode_backend,
)
from tabloader.service._protocol import dataset_from_wire, dataset_to_wire
from tests.support.seams import Inverted, logged_store


class MemStore:
    """Parts held in memory by name, as an object store's client would fetch them."""

    def __init__(self, uri: str, *, copies: bool = False) -> None:
        self.uri = uri
        self.parts: dict[str, bytes] = {}
        self.opens = 0
        self.copies = copies  # reads copy (a file-like object), as a network store's would

    def locate(self, name: str) -> str:
        return f"{self.uri}/{name}"

    def open_part(self, name: str, *, size: int, what: str, memory_map: bool) -> pa.NativeFile:
        self.opens += 1
        if name not in self.parts:
            raise FileNotFoundError(name)
        data = self.parts[name]
        if self.copies:
            return pa.PythonFile(io.BytesIO(data), mode="r")
        return pa.BufferReader(pa.py_buffer(data))


class ConstBackend:
    """Decodes every value of column ``column`` to pixels of ``value``; counts what it did."""

    name = "const"
    processes = False  # its counts are this process's

    def __init__(self, column: str = "image", value: int = 7, shape: tuple | None = None) -> None:
        self.column, self.value, self.shape = column, value, shape
        self.calls = self.values = 0
        self._lock = threading.Lock()

    def accepts(self, field: pa.Field) -> bool:
        return field.name == self.column

    def decode(self, values, *, size, max_pixels, into):
        with self._lock:
            self.calls += 1
            self.values += len(values)
        shape = self.shape or ((size, size, 3) if isinstance(size, int) else (*size, 3))
        out = np.full(shape, self.value, np.uint8)
        out.flags.writeable = False
        return [out] * len(values)


@pytest.fixture
def mem():
    """A ``mem://`` store registered for this test."""
    store = MemStore("mem://t")
    register_store("mem", lambda uri: store)
    yield store
    unregister_store("mem")


def epoch(loader, job, **kw):
    """``{row: (image, label)}`` of one epoch of ``job``."""
    with loader.open(job, epochs=1, batch_size=8, **kw) as stream:
        return {
            int(i): (img, int(label))
            for b in stream
            for i, img, label in zip(b["_id"], b["image"], b["label"], strict=True)
        }


def copy_parts(root: Path, store: MemStore) -> list[Path]:
    """The parts of ``imgs`` in the catalog at ``root`` copied into ``store``; their files."""
    with catalog.open_catalog(root) as cat:
        ds = cat.dataset("imgs")
        for part in ds.reader.parts:
            store.parts[part.path] = (root / part.path).read_bytes()
        return ds.files


# -- stores ------------------------------------------------------------------------------------
def test_a_registered_store_serves_a_jobs_batches_through_the_loader(
    image_cat_dir, mem, monkeypatch
):
    with catalog.open_catalog(image_cat_dir) as cat:
        cat.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (image_size = 16)")
        with Loader(cat, cache_bytes=8 << 20, workers=2, decode="threads") as loader:
            local = epoch(loader, "j")
    for file in copy_parts(image_cat_dir, mem):
        file.unlink()  # only the store has them now
    monkeypatch.setenv(STORAGE_ENV, "mem://t")
    with catalog.open_catalog(image_cat_dir) as cat:
        assert cat.dataset("imgs").reader.spec()[0] == "mem://t"
        with Loader(cat, cache_bytes=8 << 20, workers=2, decode="threads") as loader:
            stored = epoch(loader, "j")
    assert mem.opens > 0
    assert stored.keys() == local.keys()
    assert len(local) == 60
    for row, (img, label) in local.items():
        assert stored[row][1] == label
        assert np.array_equal(stored[row][0], img)


def test_the_readers_spec_and_wire_carry_the_stores_uri(image_cat_dir, mem, monkeypatch):
    copy_parts(image_cat_dir, mem)
    monkeypatch.setenv(STORAGE_ENV, "mem://t")
    with catalog.open_catalog(image_cat_dir) as cat:
        ds = cat.dataset("imgs")
        wire = json.loads(json.dumps(dataset_to_wire(ds)))
        assert wire["root"] == "mem://t"
        again = dataset_from_wire(wire)
        assert again.reader.store is mem
        assert again.take([3, 1]).equals(ds.take([3, 1]))
        assert ds.files[0] == Path(f"mem://t/{ds.reader.parts[0].path}")
        spec = pickle.loads(pickle.dumps(ds.reader.spec()))
        assert DatasetReader.from_spec(spec, memory_map=False).take([5]).equals(ds.take([5]))


def test_file_uris_and_bare_paths_are_the_local_store(image_cat_dir):
    with catalog.open_catalog(image_cat_dir) as cat:
        ds = cat.dataset("imgs")
        reader = DatasetReader(f"file://{image_cat_dir}", ds.reader.parts, ds.reader.schema)
        assert reader.take([0, 7]).equals(ds.take([0, 7]))
        assert ds.reader.spec()[0] == str(image_cat_dir)
    assert open_store(str(image_cat_dir)).locate("data/x") == str(image_cat_dir / "data/x")


def test_file_uris_of_another_host_are_refused(image_cat_dir):
    """``file://host/path`` names a host, not the path ``/host/path``: refused, not read
    from this machine's ``/path``."""
    with pytest.raises(
        StorageError,
        match=r"File URI 'file://server/data' names host 'server', but file:// reads this "
        r"machine's files only: give file:///path",
    ):
        open_store("file://server/data")
    with pytest.raises(StorageError, match="names host 'cat'"):  # a relative path meant
        DatasetReader("file://cat/data", [], pa.schema([]))
    local = open_store(f"file://localhost{image_cat_dir}")
    assert local.locate("data/x") == str(image_cat_dir / "data/x")


@pytest.mark.skipif(not shm_available(), reason="no /dev/shm (O_TMPFILE) on this system")
def test_a_relative_storage_path_means_the_callers_folder_in_the_service_too(
    image_cat_dir, tmp_path, monkeypatch
):
    """``$TABLOADER_STORAGE=copy`` in a client's folder: the service it starts (which runs in
    ``/``) reads the parts there too, as the client's own reads do."""
    import shutil
    import signal

    import tabloader
    from tabloader.service._client import RemoteLoader

    with catalog.open_catalog(image_cat_dir) as cat:
        cat.sql("REGISTER JOB a SELECT image, label FROM imgs WHERE label < 2")
        rows = sorted(cat.job("a").ids)
    shutil.copytree(image_cat_dir / "data", tmp_path / "copy" / "data")
    for part in (image_cat_dir / "data" / "imgs").iterdir():  # only the copy can be read
        part.write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(STORAGE_ENV, "copy")
    with RemoteLoader(image_cat_dir) as remote:
        try:
            with remote.open("a", batch_size=8, epochs=1) as stream:
                assert sorted(i for b in stream for i in b["_id"].tolist()) == rows
            with tabloader.connect(image_cat_dir) as cat:  # through the service
                assert cat.service_pid == remote.service_pid
                assert cat.dataset("imgs").files[0].is_relative_to(tmp_path / "copy")
        finally:
            os.kill(remote.service_pid, signal.SIGTERM)


def test_a_store_that_copies_its_reads_still_reads_small_values(cat):
    values = [bytes([i % 256]) * (i % 5 + 1) for i in range(300)]
    cat.import_arrow("small", pa.table({"blob": pa.array(values, pa.binary())}))
    ds = cat.dataset("small")
    assert ds.reader.parts[0].rows_per_batch >= 8  # the value index is tried
    ids = np.array([299, 3, 150, 0], np.int64)
    for copies in (False, True):
        store = MemStore("mem://small", copies=copies)
        store.parts = {p.path: (cat.root / p.path).read_bytes() for p in ds.reader.parts}
        register_store("mem", lambda uri, store=store: store)
        try:
            reader = DatasetReader("mem://small", ds.reader.parts, ds.reader.schema)
            got, errors = reader.binary_values(ids, "blob")
        finally:
            unregister_store("mem")
        assert errors == {}
        assert [bytes(v) for v in got] == [values[i] for i in ids.tolist()]
        fields = (reader.schema.get_field_index("blob"),)  # the value index's key
        assert (reader._values[(0, fields)] is None) == copies  # no positions in a copy


def test_missing_or_truncated_parts_in_a_store_name_the_part(image_cat_dir, mem, monkeypatch):
    copy_parts(image_cat_dir, mem)
    monkeypatch.setenv(STORAGE_ENV, "mem://t")
    with catalog.open_catalog(image_cat_dir) as cat:
        name = cat.dataset("imgs").reader.parts[0].path
        whole = mem.parts.pop(name)
        with pytest.raises(StorageError, match=rf"Missing data file 'mem://t/{name}'"):
            cat.dataset("imgs").take([0])
    mem.parts[name] = whole[:-10]
    with (
        catalog.open_catalog(image_cat_dir) as cat,
        pytest.raises(StorageError, match=r"has \d+ bytes, expected \d+ \(truncated"),
    ):
        cat.dataset("imgs").take([0])


def test_unknown_schemes_and_bad_registrations_are_refused():
    with pytest.raises(StorageError, match=r"No store reads nope:// URIs .*register_store"):
        open_store("nope://bucket/catalog")
    with pytest.raises(CatalogError, match="is not a URI scheme"):
        register_store("s", MemStore)
    with pytest.raises(CatalogError, match="local files, built in"):
        register_store("file", MemStore)
    with pytest.raises(CatalogError, match="not callable; give a function"):
        register_store("mem", "mem://t")
    spec = ("nope://bucket", [], pa.schema([]), True)
    with pytest.raises(StorageError, match="decode='threads'"):
        reader_of(pickle.dumps((spec, None)))  # a decode process without the store


@pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")
def test_decode_processes_read_through_the_store_of_the_readers_uri(image_cat_dir, monkeypatch):
    register_store("logged", logged_store)  # a factory of a module: it travels by name
    monkeypatch.setenv(STORAGE_ENV, f"logged://{image_cat_dir}")
    try:
        with catalog.open_catalog(image_cat_dir) as cat:
            cat.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (image_size = 16)")
            with Loader(cat, cache_bytes=8 << 20, workers=2) as loader:
                loader.wait_ready()
                got = epoch(loader, "j")
                pids = set(loader.decode_pool.pids())
            raw = cat.dataset("imgs").take(sorted(got), ["image"]).column("image")
    finally:
        unregister_store("logged")
    opened = {int(p) for p in (image_cat_dir / "opens.log").read_text().split()}
    assert pids
    assert opened & pids  # the decode processes opened parts through it
    for row, value in zip(sorted(got), raw, strict=True):
        assert np.array_equal(got[row][0], decode_image(value.as_buffer(), size=16))


# -- decode backends -----------------------------------------------------------------------------
@pytest.fixture
def const():
    backend = ConstBackend()
    register_decode_backend(backend)
    yield backend
    unregister_decode_backend(backend.name)


def test_a_registered_backend_decodes_its_column_through_the_loader(images, const):
    images.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (image_size = 16)")
    field = images.dataset("imgs").schema.field("image")
    assert decoder_for(field, image_size=16).key == "image@16+const"
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:  # processes: not for it
        got = epoch(loader, "j")
        assert loader.stats()["decodes"] == len(got) == 60
    assert const.values == 60
    assert 1 <= const.calls <= 60
    for img, _ in got.values():
        assert img.shape == (16, 16, 3)
        assert (img == 7).all()
    unregister_decode_backend("const")
    assert decoder_for(field, image_size=16).key == "image@16"
    assert isinstance(decoder_for(field).backend, decode.SimpleJpegBackend)


def test_a_backend_that_runs_in_decode_processes_travels_with_its_decoder(images):
    if not shm_available():
        pytest.skip("no /dev/shm on this system")
    images.sql("REGISTER JOB j SELECT image, label FROM imgs WITH (image_size = 16)")
    register_decode_backend(Inverted())
    try:
        with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
            loader.wait_ready()
            got = epoch(loader, "j")
            assert loader.decode_pool.pids()
    finally:
        unregister_decode_backend("inverted")
    raw = images.dataset("imgs").take(sorted(got), ["image"]).column("image")
    for row, value in zip(sorted(got), raw, strict=True):
        assert np.array_equal(got[row][0], 255 - decode_image(value.as_buffer(), size=16))


def test_the_pillow_backend_decodes_without_simplejpeg(images, monkeypatch):
    ds = images.dataset("imgs")
    values = [v.as_buffer() for v in ds.take([0, 1, 2], ["image"]).column("image")]
    turbo = decoder_for(ds.schema.field("image"), image_size=16).many(values, [0, 1, 2])
    register_decode_backend(PillowBackend())
    try:
        dec = decoder_for(ds.schema.field("image"), image_size=16)
    finally:
        unregister_decode_backend("pillow")
    assert dec.key == "image@16+pillow"

    def refused(*args, **kw):
        raise AssertionError("simplejpeg decoded")

    monkeypatch.setattr(codec.simplejpeg, "decode_jpeg", refused)
    pillow = dec.many(values, [0, 1, 2])
    for a, b in zip(turbo, pillow, strict=True):
        assert a.shape == b.shape == (16, 16, 3)
        assert np.abs(a.astype(int) - b.astype(int)).mean() < 8  # another IDCT, near


def test_misbehaving_backends_and_bad_registrations_fail_clearly(images):
    ds = images.dataset("imgs")
    for name in ("", "a b", None):
        backend = ConstBackend()
        backend.name = name
        with pytest.raises(LoaderError, match="give it a name of letters"):
            register_decode_backend(backend)
    backend = ConstBackend()
    backend.name = "simplejpeg"
    with pytest.raises(LoaderError, match="built-in default decode backend"):
        register_decode_backend(backend)
    backend = ConstBackend()
    backend.processes = "yes"
    backend.decode = None
    with pytest.raises(LoaderError, match=r"lacks decode\(\), processes; a backend has"):
        register_decode_backend(backend)
    with pytest.raises(LoaderError, match="only image columns have one"):
        Decoder("label", DecodeKind.SCALAR, backend=ConstBackend())

    class Short(ConstBackend):
        def decode(self, values, **kw):
            return super().decode(values, **kw)[:-1]

    short = Decoder("image", DecodeKind.IMAGE, image_size=16, backend=Short())
    values = [v.as_buffer() for v in ds.take([0, 1], ["image"]).column("image")]
    with pytest.raises(LoaderError, match="returned 1 values for 2 of column 'image'"):
        short.many(values, [0, 1])
    wrong = Decoder("image", DecodeKind.IMAGE, image_size=16, backend=ConstBackend(shape=(2, 2, 3)))
    reader = DatasetReader.from_spec(ds.reader.spec(), memory_map=False)
    got, errors, _ = decode_rows(reader, wrong, np.array([0, 1], np.int64))
    assert got == [None, None]
    assert sorted(errors) == [0, 1]
    assert "its decode gave uint8 (2, 2, 3), not uint8 (16, 16, 3)" in str(errors[0])
    assert "fix the decode backend 'const'" in str(errors[0])


def test_a_backend_decodes_into_the_slots_of_the_values_it_was_given(images):
    ds = images.dataset("imgs")
    first, second = (v.as_buffer() for v in ds.take([0, 1], ["image"]).column("image"))
    dec = decoder_for(ds.schema.field("image"), image_size=prep.Fit(8))
    slots: dict[int, np.ndarray] = {}

    def into(k, shape):
        slots[k] = np.empty(shape, np.uint8)
        return slots[k]

    got = dec.many([first, None, second], [0, 1, 2], into)
    assert sorted(slots) == [0, 2]  # the null's position is skipped, not shifted
    assert got[0].ctypes.data == slots[0].ctypes.data  # decoded in place
    assert got[2].ctypes.data == slots[2].ctypes.data
    assert "column 'image' is null in this row" in str(got[1])


def test_a_job_option_added_to_the_table_reaches_the_engine_end_to_end(images, monkeypatch):
    """A new job option is one row in ``JOB_OPTIONS`` (here added by the test alone): REGISTER
    checks and stores it, SHOW JOBS lists it, an open can override it, the open request and the
    spec carry it over the service's wire, and the engine reads it from the job's spec."""
    from tabloader.catalog import _options as options
    from tabloader.catalog._errors import OptionError
    from tabloader.engine._opening import OpenRequest

    toy = options.JobOption("toy", int, 0, "a knob no module knows", minimum=0, maximum=9)
    monkeypatch.setitem(options.JOB_OPTIONS, "toy", toy)
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (toy = 3, image_size = 16)")
    with pytest.raises(OptionError, match=r"toy"):
        images.sql("REGISTER JOB k SELECT image FROM imgs WITH (toy = 12)")
    listed = images.sql("SHOW JOBS").to_pylist()
    assert "toy=3" in next(r["options"] for r in listed if r["name"] == "j")
    request = OpenRequest.make("j", epochs=1, batch_size=4, toy=5)
    assert OpenRequest.from_wire(request.to_wire()).options["toy"] == 5  # the service's wire
    with Loader(images, cache_bytes=1 << 20) as loader:
        for given, seen in (({}, 3), ({"toy": 5}, 5)):
            with loader.open("j", epochs=1, batch_size=4, **given) as stream:
                assert stream.take() is not None
                assert loader.scheduler("imgs").jobs["j"].spec.toy == seen
