"""Decode processes: the same pixels as threads, into shared memory, and failures contained."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import numpy as np
import pytest

from tabloader.catalog._errors import CacheError, LoaderError, RowReadError
from tabloader.engine import Loader
from tabloader.engine._arena import shm
from tabloader.engine._arena.shm import SHM_DIR, Segment, process_alive, shm_available
from tabloader.engine._prepare.prep import decoder_for
from tabloader.engine.decode import decode_image
from tests.support.faults import KillsOnce, Poisoned, Slow
from tests.support.polling import wait_for
from tests.support.shm import named_shm_of

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")


def epoch(loader, job, **kw):
    with loader.open(job, epochs=1, **kw) as stream:
        return {int(i): img for b in stream for i, img in zip(b["_id"], b["image"], strict=True)}


def test_processes_decode_the_same_pixels_as_threads_into_shared_memory(images):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=8 << 20, workers=2, decode="threads") as loader:
        assert loader.segment is None
        threads = epoch(loader, "j", batch_size=8)
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        segment = loader.segment
        assert segment is not None
        # No name to leak: only the descriptor, which the decode processes inherited
        assert os.readlink(f"/proc/self/fd/{segment.fd}").endswith("(deleted)")
        procs = epoch(loader, "j", batch_size=8)
        assert loader.stats()["decodes"] == len(procs)  # counted from the processes
        pids = set(loader.decode_pool.pids())
        assert pids
        assert os.getpid() not in pids
    assert segment.fd == -1  # closed: the memory goes when the last mapping does
    assert threads.keys() == procs.keys() == set(images.job("j").ids)
    raw = images.dataset("imgs").take(sorted(procs), ["image"]).column("image")
    for row, value in zip(sorted(procs), raw, strict=True):
        expected = decode_image(value.as_buffer(), size=16)
        assert np.array_equal(procs[row], expected)
        assert np.array_equal(threads[row], expected)


def test_a_killed_decode_process_is_replaced(images):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB k SELECT image FROM imgs WITH (image_size = 12)")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        assert len(epoch(loader, "j", batch_size=8)) == images.job("j").num_rows
        pool = loader.decode_pool
        killed = pool.pids()
        assert killed
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        for _ in range(500):  # the executor notices its dead processes (bounded wait)
            if pool.status == "broken":
                break
            threading.Event().wait(0.01)
        assert pool.status == "broken"
        assert len(epoch(loader, "k", batch_size=8)) == images.job("k").num_rows
        assert pool.status == "running"
        assert pool.pids()
        assert not set(pool.pids()) & set(killed)  # new processes
        assert loader.arena.stats().pinned == 0


def _with_decoder(loader, monkeypatch, make):
    """Every decode the loader sends to its processes uses ``make(decoder)`` instead."""
    real = loader.decode_pool.submit

    def submit(reader, dec, rows, offsets):
        wrapped = make(column=dec.column, kind=dec.kind, image_size=dec.image_size)
        return real(reader, wrapped, rows, offsets)

    monkeypatch.setattr(loader.decode_pool, "submit", submit)


def _epoch_once(loader, on_error, after_first=lambda: None):
    """One epoch of job ``j``, asserting no row comes twice: ``{row: image}``."""
    got: dict[int, np.ndarray] = {}
    with loader.open("j", batch_size=4, epochs=1, on_error=on_error) as stream:
        for n, batch in enumerate(stream):
            for i, img in zip(batch["_id"].tolist(), batch["image"], strict=True):
                assert i not in got, f"row {i} twice"
                got[i] = img
            if n == 0:
                after_first()
    assert loader.arena.stats().pinned == 0
    return got


def _assert_decoded(images, got, size=16):
    raw = images.dataset("imgs").take(sorted(got), ["image"]).column("image")
    for row, value in zip(sorted(got), raw, strict=True):
        assert np.array_equal(got[row], decode_image(value.as_buffer(), size=size))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_decode_process_killed_mid_epoch_costs_no_row(images, monkeypatch, on_error):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    killed = []

    def kill():
        pids = loader.decode_pool.pids()
        assert pids
        assert os.getpid() not in pids
        os.kill(pids[0], signal.SIGKILL)
        killed.append(pids[0])

    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        # decodes stay in flight while we kill (60 rows, 2 processes: 1.5 s)
        _with_decoder(loader, monkeypatch, lambda **kw: Slow(**kw, delay=0.05))
        got = _epoch_once(loader, on_error, kill)
        for _ in range(1000):  # the executor notices (bounded wait)
            if killed[0] not in loader.decode_pool.pids():
                break
            threading.Event().wait(0.01)
        assert killed[0] not in loader.decode_pool.pids()
        assert len(_epoch_once(loader, on_error)) == images.job("j").num_rows  # replaced
    assert got.keys() == set(images.job("j").ids)  # none skipped for the fault
    _assert_decoded(images, got)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_rows_in_flight_when_their_process_dies_are_decoded_again(
    images, monkeypatch, tmp_path, on_error
):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    marker = tmp_path / "killed"
    row = int(images.job("j").ids[7])
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        _with_decoder(
            loader, monkeypatch, lambda **kw: KillsOnce(**kw, row=row, marker=str(marker))
        )
        got = _epoch_once(loader, on_error)
    assert marker.exists()  # its process died while decoding it
    assert got.keys() == set(images.job("j").ids)
    _assert_decoded(images, got)


def test_a_row_that_kills_its_decode_process_twice_is_bad_data(images, monkeypatch):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    ids = images.job("j").ids
    poison = int(ids[len(ids) // 2])
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        _with_decoder(loader, monkeypatch, lambda **kw: Poisoned(**kw, poison=poison))
        with pytest.raises(
            RowReadError,
            match=f"row {poison}, column 'image': decoding it killed a decode process 2 times "
            r"\(a crash, or its memory cap\), so it counts as bad data",
        ) as err:
            epoch(loader, "j", batch_size=4)
        assert err.value.row_id == poison
        got = _epoch_once(loader, "skip")
    assert got.keys() == set(ids) - {poison}  # only the poison row is left out
    _assert_decoded(images, got)


def test_decode_processes_start_at_the_first_fixed_size_decode_threads_decode_meanwhile(images):
    """A loader starts its decode processes once its threads have decoded the first fixed-size
    values (and decodes in its threads until they run): a loader of augmented jobs never starts
    them, and their start (a forkserver, its imports) does not take a core from the first
    batch's decodes."""
    images.sql("REGISTER JOB fixed SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB aug SELECT image FROM imgs WITH (augment = 'RandomResizedCrop(8)')")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        procs = loader.decode_pool
        assert procs.status == "idle"
        with loader.open("aug", batch_size=4, epochs=1) as stream:
            assert sum(len(b["_id"]) for b in stream) == images.job("aug").num_rows
        assert procs.status == "idle"  # the aspect-kept decode is the threads'
        with loader.open("fixed", batch_size=4, epochs=1) as stream:
            first = stream.take()  # decoded in a thread: the processes were not running
            assert first is not None
            assert procs.status in ("starting", "running")
            rest = sum(len(b["_id"]) for b in stream)
        assert len(first["_id"]) + rest == images.job("fixed").num_rows
        for _ in range(6000):  # bounded: they start in the background
            if len(procs.pids()) == 2:
                break
            threading.Event().wait(0.01)
        assert len(procs.pids()) == 2
    assert procs.status == "closed"
    assert procs.pids() == []


def test_a_catalog_without_bytes_starts_no_decode_processes(tmp_path):
    import pyarrow as pa

    from tabloader import catalog

    cat = catalog.open_catalog(tmp_path / "cat")
    cat.import_arrow("nums", pa.table({"x": list(range(64)), "y": [0.5] * 64}))
    cat.sql("REGISTER JOB j SELECT x, y FROM nums")
    with Loader(cat, cache_bytes=8 << 20, workers=2) as loader:
        with loader.open("j", batch_size=16, epochs=1) as stream:
            assert sum(len(b["x"]) for b in stream) == 64
        assert loader.decode_pool is not None  # made, for a dataset of images imported later
        assert loader.decode_pool.status == "idle"  # never started
        assert loader.decode_pool.pids() == []
    cat.close()


def test_a_closed_decode_pool_refuses_work(images):
    ds = images.dataset("imgs")
    dec = decoder_for(ds.schema.field("image"), image_size=16)
    loader = Loader(images, cache_bytes=8 << 20, workers=2)
    procs = loader.decode_pool
    loader.close()
    with pytest.raises(LoaderError, match="decode processes are stopped; create a new Loader"):
        procs.submit(ds.reader, dec, np.arange(2), np.zeros(2, np.int64))
    assert procs.status == "closed"  # nothing started again
    assert procs.pids() == []


def test_rows_of_a_decode_process_that_died_mid_task_fail_clearly(images, monkeypatch):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        real = loader.decode_pool.submit

        def dies(*args):
            future = Future()
            future.set_exception(BrokenProcessPool("a child process terminated abruptly"))
            monkeypatch.setattr(loader.decode_pool, "submit", real)  # once
            return future

        monkeypatch.setattr(loader.decode_pool, "submit", dies)
        with pytest.raises(LoaderError, match="A decode process failed .*terminated abruptly"):
            epoch(loader, "j", batch_size=4)
        assert len(epoch(loader, "j", batch_size=4)) == images.job("j").num_rows  # retried
        stats = loader.arena.stats()
        assert stats.pinned == 0
        assert stats.entries == images.job("j").num_rows


def test_a_decode_that_cannot_start_fails_its_batches_instead_of_hanging(images, monkeypatch):
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        real = loader.decode_pool.submit

        def refuses(*args):
            monkeypatch.setattr(loader.decode_pool, "submit", real)  # once
            raise LoaderError("The decode processes are stopped; create a new Loader.")

        monkeypatch.setattr(loader.decode_pool, "submit", refuses)
        outcome: list = []

        def run():
            try:
                outcome.append(len(epoch(loader, "j", batch_size=4)))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(60)  # bounded: a batch whose decode never started used to wait forever
        assert not thread.is_alive(), "the epoch hung on a decode that never started"
        with pytest.raises(LoaderError, match="decode processes are stopped"):
            raise outcome[0]
        assert len(epoch(loader, "j", batch_size=4)) == images.job("j").num_rows
        stats = loader.arena.stats()
        assert stats.pinned == 0  # the reserved slots went back
        assert stats.entries == images.job("j").num_rows


def test_a_corrupt_image_is_a_row_error_from_a_decode_process(corrupt):
    cat, bad = corrupt
    n = cat.dataset("imgs").num_rows
    cat.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(cat, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        stream = loader.open("j", batch_size=n, epochs=1)
        with pytest.raises(RowReadError, match=f"row {bad}") as info:
            stream.next_batch()
        assert info.value.row_id == bad
        assert info.value.column == "image"
        stream.close()
        assert loader.arena.stats().pinned == 0


def test_a_memory_filesystem_too_small_is_a_clear_error():
    free = os.statvfs(SHM_DIR)
    too_big = free.f_bavail * free.f_frsize + (1 << 40)
    with pytest.raises(CacheError, match="Cannot allocate .* shared memory .* lower the cache"):
        Segment.new("test", too_big)


def test_a_segment_is_allocated_in_the_background():
    size = 8 << 20
    segment = Segment.new("test", size)
    try:
        deadline = time.monotonic() + 60
        while os.fstat(segment.fd).st_blocks * 512 < size:  # written pages or fallocate's
            assert time.monotonic() < deadline, "the segment was never allocated"
            time.sleep(0.01)
    finally:
        segment.close()


def test_a_failed_background_allocation_is_logged(monkeypatch, caplog):
    def full(fd, offset, size):
        raise OSError(28, os.strerror(28))  # ENOSPC: /dev/shm filled up since the check

    monkeypatch.setattr(os, "posix_fallocate", full)
    segment = Segment.new("test", 1 << 20)
    segment.close()  # waits for the allocation
    assert "Cannot allocate 1048576 bytes of shared memory in /dev/shm" in caplog.text
    assert "lower the cache size" in caplog.text


def test_the_background_allocation_goes_in_chunks_and_stops_with_the_segment(monkeypatch):
    """A cold service's first batch decodes while its cache is allocated: the allocation
    goes ALLOCATE_CHUNK at a time with pauses between, and a segment closed meanwhile stops
    it (close does not wait for the rest of a 1 GiB cache)."""
    calls = []
    real = os.posix_fallocate
    monkeypatch.setattr(shm, "ALLOCATE_PAUSE_S", 30.0)
    monkeypatch.setattr(os, "posix_fallocate", lambda *a: calls.append(a[1:]) or real(*a))
    segment = Segment.new("test", 4 * shm.ALLOCATE_CHUNK)
    deadline = time.monotonic() + 10
    while not calls:
        assert time.monotonic() < deadline, "the allocation never started"
        time.sleep(0.01)
    segment.close()  # joins the thread: had it sat out the pause, it would go on to chunk 2
    assert calls == [(0, shm.ALLOCATE_CHUNK)]


def test_a_loader_falls_back_to_threads_when_shared_memory_is_short(images, monkeypatch, caplog):
    def full(tag, size):
        raise CacheError(f"Cannot allocate {size} bytes of shared memory in /dev/shm")

    monkeypatch.setattr(Segment, "new", full)
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=8 << 20) as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        assert loader.segment is None
        assert loader.decode_pool is None
        assert len(epoch(loader, "j", batch_size=8)) == images.job("j").num_rows
    assert "Decoding in threads instead" in caplog.text


def test_bad_decode_option_is_refused(images):
    with pytest.raises(LoaderError, match="decode='gpu': use 'processes' or 'threads'"):
        Loader(images, decode="gpu")


NO_GUARD = textwrap.dedent(
    """
    import os, sys
    from tabloader import catalog
    from tabloader.engine import Loader
    from tabloader.engine._arena import shm
    with open(sys.argv[2], "a") as runs:  # no `if __name__ == "__main__":` guard
        runs.write(f"{os.getpid()}\\n")
    cat = catalog.open_catalog(sys.argv[1])
    with Loader(cat, cache_bytes=1 << 24, workers=2, decode="processes") as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        print(sum(len(b["_id"]) for b in loader.open("j", batch_size=8, epochs=1)))
    """
)


def test_a_script_without_a_main_guard_runs_once(images, tmp_path):
    """Decode processes come from a forkserver, which would run the main script again in
    each of them (as multiprocessing's spawn does): they must not."""
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    n = images.job("j").num_rows
    images.close()
    script, runs = tmp_path / "train.py", tmp_path / "runs.txt"
    script.write_text(NO_GUARD)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cat"), str(runs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(n)]
    assert len(runs.read_text().split()) == 1  # the decode processes did not run it


WITHOUT_TORCH = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tabloader import catalog
    from tabloader.engine import Loader
    from tabloader.engine._arena import shm
    from tabloader.engine.decode import decode_image
    cat = catalog.open_catalog(sys.argv[1])
    raw = cat.dataset("imgs").take(cat.job("j").ids, ["image"]).column("image")
    expected = {i: decode_image(v.as_buffer(), size=16) for i, v in zip(cat.job("j").ids, raw)}
    assert "torch" not in sys.modules
    with Loader(cat, cache_bytes=1 << 24, workers=2, decode="processes") as loader:
        loader.wait_ready()  # its decode processes run (they start lazily)
        assert loader.decode_pool is not None
        got = {
            int(i): img
            for b in loader.open("j", batch_size=8, epochs=1)
            for i, img in zip(b["_id"], b["image"])
        }
        assert loader.stats()["decodes"] == len(got)  # in the decode processes
    assert got.keys() == expected.keys()
    assert all(np.array_equal(got[i], expected[i]) for i in got)
    print(len(got))
    """
)


def test_decode_processes_resize_with_pillow_where_torch_is_missing(images, tmp_path):
    """torch is an optional dependency: without it the decode processes start, and resize
    to the same pixels as this process does (Pillow's)."""
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    n = images.job("j").num_rows
    images.close()
    blocker = tmp_path / "no-torch" / "torch"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed here')\n")
    script = tmp_path / "no_torch.py"
    script.write_text(WITHOUT_TORCH)
    path = os.pathsep.join([str(blocker.parent), *sys.path])
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cat")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(n)]


KILLED = textwrap.dedent(
    """
    import json, os, sys, time
    from tabloader import catalog
    from tabloader.engine import Loader
    from tabloader.engine._arena import shm
    cat = catalog.open_catalog(sys.argv[1])
    loader = Loader(cat, cache_bytes=1 << 24, workers=2, decode="processes")
    loader.wait_ready()  # its decode processes run (they start lazily)
    stream = loader.open("j", batch_size=8)
    stream.next_batch()  # mid-epoch
    pids = loader.decode_pool.pids()
    with open(sys.argv[2] + ".tmp", "w") as f:
        json.dump(pids, f)
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(600)  # until killed
    """
)


def test_a_killed_loader_leaves_nothing_in_shared_memory_or_the_temporary_folder(
    images, tmp_path, short_tmp
):
    """SIGKILL runs no clean-up code: the arena has no name to leave, the decode processes
    exit by themselves, and the last of them removes multiprocessing's temporary folder."""
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    images.close()
    tmp, out = short_tmp, tmp_path / "pids.json"
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "cat"), str(out)],
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        wait_for(lambda: out.exists() or proc.poll() is not None, "the loader's first batch")
        assert proc.poll() is None
        pids = json.loads(out.read_text())
        assert pids
        named = named_shm_of(proc.pid, *pids)
        assert not named  # neither the arena nor the pool's locks have a name
        assert list(tmp.iterdir())  # multiprocessing's folder (the forkserver's socket)
    finally:
        proc.kill()
        proc.wait(60)
    wait_for(lambda: not any(process_alive(p) for p in pids), "the decode processes to exit")
    assert not list(tmp.iterdir())


LONG_TMPDIR = textwrap.dedent(
    """
    import sys
    from tabloader import catalog
    from tabloader.engine import Loader
    from tabloader.engine._arena import shm
    loader = Loader(catalog.open_catalog(sys.argv[1]), cache_bytes=1 << 24, decode="processes")
    loader.wait_ready()
    n = sum(len(b["_id"]) for b in loader.open("j", batch_size=8, epochs=1))
    print(n, loader.decode_pool.status)
    """
)


def test_a_temporary_folder_too_deep_for_the_forkserver_socket_is_one_clear_warning(
    images, tmp_path
):
    """multiprocessing binds its forkserver's socket in $TMPDIR: a path too long for a Unix
    socket is named with the fix, once, and the loader's threads decode instead."""
    images.sql("REGISTER JOB j SELECT image FROM imgs WITH (image_size = 16)")
    rows = images.job("j").num_rows
    images.close()
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    script = tmp_path / "deep.py"
    script.write_text(LONG_TMPDIR)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cat")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(deep)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(rows), "idle"]  # every row, by the threads
    said = proc.stderr
    assert said.count(f"The temporary folder {deep} is too deep") == 1, said
    assert "set TMPDIR to a shorter folder" in said
    assert "decoded in the loader's threads instead" in said


def _task_sizes(monkeypatch) -> list[int]:
    """The rows of each task sent to the decode processes from now on."""
    from tabloader.engine._prepare.decoding import DecodePool

    sizes: list[int] = []
    submit = DecodePool.submit

    def counted(self, reader, dec, rows, offsets):
        sizes.append(len(rows))
        return submit(self, reader, dec, rows, offsets)

    monkeypatch.setattr(DecodePool, "submit", counted)
    return sizes


def test_rows_decoded_ahead_take_at_most_an_eighth_of_a_small_arena(images, monkeypatch):
    """Rows decoded ahead hold slots while their task runs: in an arena of 24 slots (sized
    for the batches in flight, as a test or a tight cache is) a short task takes at most 3
    rows beyond its batch's misses, not the hundreds a 256 KiB task of 16x16 images would,
    and nothing goes out uncached."""
    from tabloader.engine._arena.arena import CacheOvershootWarning

    sizes = _task_sizes(monkeypatch)
    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=24 * 16 * 16 * 3, workers=2) as loader:
        loader.wait_ready()
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheOvershootWarning)
            a = loader.open("a", epochs=1, batch_size=4, prefetch=2)
            rows = sum(len(batch["_id"]) for batch in a)
            a.close()
        assert loader.arena.holds(0, 16 * 16 * 3) == 24  # the job's one space
    assert rows == 60
    assert sizes
    assert max(sizes) <= 4 + 24 // 8


def test_short_decode_tasks_take_the_rows_their_job_cuts_next(images, monkeypatch):
    """A decode process's task costs the loader a dozen wake-ups whatever its size: a batch
    whose misses fill less than half a task decodes the rows its job cuts next with them
    (two jobs cutting at other boundaries made tasks of a third of a batch). Every row is
    still decoded once, with the same pixels."""
    sizes = _task_sizes(monkeypatch)
    images.sql("REGISTER JOB a SELECT image FROM imgs WITH (image_size = 16)")
    images.sql("REGISTER JOB b SELECT image FROM imgs WITH (image_size = 16)")
    with Loader(images, cache_bytes=8 << 20, workers=2) as loader:
        loader.wait_ready()
        sizes.clear()
        # rows sampled ahead beyond the batches cut (a prefetch of the whole epoch would cut
        # every row as it is sampled, and leave no queue to fill a short task from)
        a = loader.open("a", epochs=1, batch_size=4, prefetch=2, lookahead=60)
        b = loader.open("b", epochs=1, batch_size=6, prefetch=2, lookahead=60)
        got: dict[str, dict[int, np.ndarray]] = {"a": {}, "b": {}}
        for name, stream in (("a", a), ("b", b)):
            while (batch := stream.take()) is not None:
                got[name].update(zip(batch["_id"].tolist(), batch["image"], strict=True))
        a.close()
        b.close()
        decodes = loader.stats()["decodes"]
    assert decodes == 60 == sum(sizes)  # each row decoded once, for both jobs
    assert len(sizes) <= 60 // 4 // 2  # far fewer tasks than job a's 15 batches
    assert got["a"].keys() == got["b"].keys() == set(range(60))
    raw = images.dataset("imgs").take(list(range(60)), ["image"]).column("image")
    for row, value in enumerate(raw):
        expected = decode_image(value.as_buffer(), size=16)
        assert np.array_equal(got["a"][row], expected)
        assert np.array_equal(got["b"][row], expected)
