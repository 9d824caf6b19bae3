"""Benchmark ``storage``: training from object storage through requests of 10 ms (issue 47).

The same generated JPEGs (``--images``, ``--size``) are served by an S3 server on loopback
(moto's server mode, in a process of its own, each object's value kept in memory: moto would
read a whole object for each ranged GET) behind ``tests/support/s3proxy.py``, which adds
``--latency`` seconds to every request and answers the GETs of an object from its own memory
once it has fetched it whole (moto spends ~6 ms of CPU a GET, on the 2 cores the loaders have:
it would measure moto, not the loaders), and read side by side in one run, each decoding every
image and resizing it to ``--image-size`` square (the work a training step asks for):

=========================  ===================================================================
``DataLoader(2) S3``       ``torch.utils.data.DataLoader(num_workers=2, shuffle=True)`` over a
                           map-style dataset that reads each image object with boto3's
                           ``get_object`` (a client per worker), as users write it; decodes
                           with Pillow (``draft`` + ``resize``)
``DataLoader(2) local``    the same over the image files on local disk (its reference)
``LitData S3``             ``litdata.StreamingDataset`` (its ``optimize`` output, chunks of
                           ``--chunk-bytes``, uploaded to the bucket) in its
                           ``StreamingDataLoader(num_workers=2)``; the same decode in
                           ``__getitem__``; its own local chunk cache as it comes
``LitData local``          the same over the ``optimize`` folder on local disk
``tabloader 1 job S3``     one job of a dataset stored in the bucket (``WITH (storage = ...)``),
                           an in-process ``Loader``, storage tier off: the read-ahead alone
``tabloader 1 job local``  the same job over a local copy of the dataset (its reference)
``tabloader 4 jobs S3``    four jobs of the bucket's dataset at once, a storage tier of
                           ``--tier`` times the dataset (0: off)
``tabloader 4 jobs local`` the same four jobs over the local copy (its reference)
=========================  ===================================================================

The default images are ImageNet's typical 500x375, decoded to 224 square, the work a
training step asks for. With a decode much cheaper than that (``--size 320x240 --image-size
64``: ~0.2 ms an image, 5,000 img/s on 2 cores) a request costs as much CPU as an image (0.17-
0.27 ms in the client, obstore included, and 0.13-0.18 ms in the proxy, on the same 2 cores:
measured with 600 GETs of 36 KB, 64 in flight), so the latency-hidden ratio there measures
requests against decodes; it is reported in docs/benchmarks.md beside the default's.

``--arms`` picks some of the three kinds (``dataloader,litdata,tabloader``), each with its
local reference; the quick form (``--quick``: 48 small images, two epochs) is what
tests/benchmarks/test_bench_storage.py runs.

Each runs ``--epochs`` epochs in a fresh process (the loaders in this one). Per epoch: seconds,
images per second (all jobs' rows over the epoch's wall time), and the GET requests and body
bytes the proxy passed, against the dataset's bytes (the image files'). The *latency-hidden
ratio* of an S3 run is its last epoch's images per second over its local reference's. Target
(``TARGET``): one tabloader job through the latency at >= 0.8x its local speed (tier off). The
decoded arena of tabloader holds ``--cache`` of the decoded dataset (the DataLoaders and
LitData keep none), and its read-ahead ``--readahead`` of the stored one, so that its later
epochs decode and read storage again as theirs do (a dataset larger than the memory).

LitData (the ``bench`` extra; ``pip install litdata 'torch==X'`` with the torch you have,
or pip upgrades it) reads S3 through obstore, which refuses ``http://`` endpoints unless told
``allow_http``: its processes get a ``sitecustomize`` that adds that option and nothing else.
Without litdata its rows say why. The S3 server is the tests' (``tests/support/s3proxy.py``:
run from a checkout). The machine is shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import format_table, positive_int, write_json
from benchmarks._cpu import cpu_line
from benchmarks._verdict import Verdict, verdict

__all__ = ["TARGET", "add_arguments", "run"]

TARGET = 0.8  # one tabloader job through the latency / from a local copy (tier off)
ARMS = ("dataloader", "litdata", "tabloader")
BUCKET = "bench"
KEYS = ("testing", "testing")  # moto's credentials

# The loopback S3 server, in a process of its own (moto spends ~6 ms of CPU a request: in this
# process it would take the GIL from the loaders): prints its endpoints, then answers each
# "mark" line on stdin with the GETs and body bytes the proxy passed so far, per prefix.
_SERVER = """
import copy, json, sys, time
import moto.s3.models as models
from tests.support import s3proxy
from tests.support.s3proxy import Faults, S3Proxy, loopback_s3

# moto reads an object's whole value (from a temporary file past 16 MiB) for each GET, a ranged
# one too, and then slices it: a 150 KB range of a 40 MB part would cost moto 40 MB of reads.
# S3 does not; here each object's value is read once and kept in memory, for every arm alike.
_value = models.FakeKey.value
def _get(key):
    kept = key.__dict__.get("_bench_value")
    if kept is None:
        kept = key.__dict__["_bench_value"] = _value.fget(key)
    return kept
def _set(key, value):
    key.__dict__.pop("_bench_value", None)
    _value.fset(key, value)
models.FakeKey.value = property(_get, _set)
# moto also spends ~6 ms of CPU on every GET (werkzeug, its routing and its models), on the
# 2 cores the loaders run on: a cost S3 puts on its own servers, not on the client's. So the
# proxy answers a GET of an object it fetched whole once from its own memory (the headers
# moto gave, the range sliced as S3 slices it), and forwards everything else; a PUT, POST
# or DELETE of a key forgets it. Every arm's GETs pass this same path and its latency.
class MemoryGets(S3Proxy):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._objects = {}

    def _forward(self, request):
        path = request.path
        if request.method != "GET" or "?" in request.target or path.count("/") < 2:
            if request.method in ("PUT", "POST", "DELETE"):
                self._objects.pop(path, None)
            return super()._forward(request)
        kept = self._objects.get(path)
        if kept is None:
            whole = copy.copy(request)
            whole.headers = [h for h in request.headers if h[0].strip().lower() != "range"]
            status, lines, body = super()._forward(whole)
            if status != 200:
                return super()._forward(request)
            skip = ("content-length", "content-range", "connection", "transfer-encoding")
            heads = [h for h in lines[1:] if h and h.split(":", 1)[0].strip().lower() not in skip]
            kept = self._objects[path] = (heads, body)
        heads, body = kept
        spec = request.header("range")
        if not spec:
            return 200, ["HTTP/1.1 200 OK", *heads], body
        start, _, end = spec.split("=", 1)[1].partition("-")
        if not start:  # a suffix: the last N bytes
            first, last = max(0, len(body) - int(end)), len(body) - 1
        else:
            first, last = int(start), min(int(end) if end else len(body) - 1, len(body) - 1)
        total = f"Content-Range: bytes {first}-{last}/{len(body)}"
        return 206, ["HTTP/1.1 206 Partial Content", *heads, total], body[first : last + 1]

s3proxy.S3Proxy = MemoryGets
with loopback_s3(Faults(latency=float(sys.argv[1]))) as s3:
    print(json.dumps({"url": s3.url, "server_url": s3.server_url}), flush=True)
    for line in sys.stdin:
        stats = s3.proxy.stats
        gets, body = {}, {}
        for key, n in list(stats.requests.items()):
            if key.startswith("GET "):
                prefix = key[4:].split("/")[2] if key.count("/") > 2 else ""
                gets[prefix] = gets.get(prefix, 0) + n
        for path, n in list(stats.body_bytes.items()):
            prefix = path.split("/")[2] if path.count("/") > 2 else ""
            body[prefix] = body.get(prefix, 0) + n
        print(json.dumps({"gets": gets, "bytes": body}), flush=True)
"""

# A DataLoader or LitData run, in a process of its own: one JSON line per epoch.
_CHILD = """
import io, json, sys, time
import numpy as np
from PIL import Image
cfg = json.loads(sys.argv[1])
size = cfg["image_size"]

def decode(data):
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (size, size))
    return np.asarray(im.convert("RGB").resize((size, size)))

def rows(batch):
    return len(batch)

import torch
from torch.utils.data import DataLoader, Dataset
if cfg["kind"] == "dataloader":
    class Images(Dataset):
        def __init__(self):
            self.items, self.client = cfg["items"], None
        def __len__(self):
            return len(self.items)
        def __getitem__(self, i):
            if cfg["s3"]:
                if self.client is None:  # one client per worker process
                    import boto3
                    self.client = boto3.client("s3", endpoint_url=cfg["url"])
                got = self.client.get_object(Bucket=cfg["bucket"], Key=self.items[i])
                data = got["Body"].read()
            else:
                with open(self.items[i], "rb") as f:
                    data = f.read()
            return decode(data)
    loader = DataLoader(Images(), batch_size=64, shuffle=True, num_workers=2, collate_fn=rows)
else:
    from litdata import StreamingDataLoader, StreamingDataset
    class Decoded(StreamingDataset):
        def __getitem__(self, index):
            return decode(super().__getitem__(index)["image"])
    options = {"endpoint_url": cfg["url"]} if cfg["s3"] else None
    ds = Decoded(cfg["input"], shuffle=True, storage_options=options, cache_dir=cfg["cache"])
    loader = StreamingDataLoader(ds, batch_size=64, num_workers=2, collate_fn=rows)
print(json.dumps({"ready": True}), flush=True)
for epoch in range(cfg["epochs"]):
    t = time.perf_counter()
    n = sum(loader)
    print(json.dumps({"epoch": epoch, "s": time.perf_counter() - t, "rows": n}), flush=True)
"""

# obstore refuses an http:// endpoint unless allow_http: LitData does not pass it
_SITECUSTOMIZE = """
try:
    import obstore.store as _store
    _S3Store = _store.S3Store
    def S3Store(*args, client_options=None, **kwargs):
        options = {**(client_options or {}), "allow_http": True}
        return _S3Store(*args, client_options=options, **kwargs)
    _store.S3Store = S3Store
except ImportError:
    pass
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options."""
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument(
        "--arms", type=_arms_option, default=ARMS, help=f"some of {','.join(ARMS)} (default: all)"
    )
    parser.add_argument("--images", type=positive_int, default=1200, help="generated JPEGs")
    parser.add_argument("--size", default="500x375", help="their size, WxH")
    parser.add_argument("--image-size", type=positive_int, default=224, help="decoded, square")
    parser.add_argument("--epochs", type=positive_int, default=2, help="epochs of each run")
    parser.add_argument("--latency", type=float, default=0.01, help="seconds added a request")
    parser.add_argument("--tier", type=float, default=1.0, help="4 jobs' tier, x the dataset")
    parser.add_argument("--cache", type=float, default=0.10, help="arena, x decoded dataset")
    parser.add_argument("--chunk-bytes", default="8MB", help="LitData's chunks")
    parser.add_argument("--workers", type=positive_int, default=2, help="tabloader's workers")
    parser.add_argument(
        "--readahead",
        type=float,
        default=0.4,
        help="tabloader's read-ahead, x the dataset (under 1: later epochs fetch again)",
    )
    parser.add_argument("--out", default="bench-results/storage.json", help="JSON output")


def _arms_option(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(
            f"unknown arm(s) {', '.join(unknown) or '(none)'}: use some of {','.join(ARMS)}"
        )
    return arms


class _Server:
    """The loopback S3 server's process (``_SERVER``): its endpoints and its counts."""

    def __init__(self, latency: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(latency)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert self.proc.stdout is not None
        assert self.proc.stdin is not None
        urls = json.loads(self.proc.stdout.readline())
        self.url, self.server_url = urls["url"], urls["server_url"]
        self._lock = threading.Lock()

    def mark(self, prefix: str) -> tuple[int, int]:
        """(GETs, body bytes) the proxy passed so far under ``prefix`` of the bucket."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write("mark\n")
            self.proc.stdin.flush()
            counts = json.loads(self.proc.stdout.readline())
        return counts["gets"].get(prefix, 0), counts["bytes"].get(prefix, 0)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _epochs(marks: list[tuple[float, int, int, int]]) -> list[dict[str, float]]:
    """Per epoch from ``(seconds, rows, GETs, bytes)`` marks at each epoch's end (the first
    at the start): seconds, rows, img/s, GETs, bytes."""
    out = []
    for (_, _, g0, b0), (s, rows, g1, b1) in itertools.pairwise(marks):
        out.append(
            {
                "s": s,
                "rows": rows,
                "img_s": rows / s if s else 0.0,
                "gets": g1 - g0,
                "bytes": b1 - b0,
            }
        )
    return out


def _child(server: _Server, cfg: dict[str, Any], prefix: str, env: dict[str, str]) -> Any:
    """A DataLoader or LitData run in a process of its own: its epochs, or why it failed."""
    marks: list[tuple[float, int, int, int]] = []
    with (
        tempfile.TemporaryFile("w+") as stderr,
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(cfg)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            if msg.get("ready"):
                marks.append((0.0, 0, *server.mark(prefix)))
            else:
                marks.append((msg["s"], msg["rows"], *server.mark(prefix)))
        if proc.wait() != 0:
            stderr.seek(0)
            err = stderr.read().strip()
            return err.splitlines()[-1] if err else f"exit {proc.returncode}"
    return _epochs(marks)


def _tabloader(
    server: _Server, cat: Any, jobs: list[str], args: argparse.Namespace, prefix: str, **kw: Any
) -> Any:
    """Jobs of an in-process ``Loader`` for ``args.epochs`` epochs, in step (each epoch's end
    waits for every job), timed from their open (after the decode processes started), as a
    DataLoader's first epoch is from its iteration."""
    from tabloader.engine import Loader

    barrier = threading.Barrier(len(jobs) + 1)
    errors: list[BaseException] = []
    rows = [0] * len(jobs)
    with Loader(cat, workers=args.workers, **kw) as loader:
        loader.wait_ready(60)
        marks: list[tuple[float, int, int, int]] = [(0.0, 0, *server.mark(prefix))]
        t0 = time.perf_counter()
        streams = [loader.open(j, batch_size=64, epochs=args.epochs) for j in jobs]

        def consume(i: int) -> None:
            try:
                for _ in range(args.epochs):
                    rows[i] += sum(len(b["_id"]) for b in streams[i].iter_epoch())
                    barrier.wait(600)  # the epoch's end
                    barrier.wait(600)  # marked
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        try:
            done = 0  # rows of the epochs marked (every job waits at the barrier: none moves)
            for _ in range(args.epochs):
                barrier.wait(600)
                seconds = time.perf_counter() - t0
                marks.append((seconds, sum(rows) - done, *server.mark(prefix)))
                done = sum(rows)
                barrier.wait(600)
                t0 = time.perf_counter()
        except threading.BrokenBarrierError:
            pass
        for t in threads:
            t.join(600)
        for s in streams:
            s.close()
    if errors:
        return f"{type(errors[0]).__name__}: {errors[0]}"
    return _epochs(marks)


def _prepare(root: Path, server: _Server, args: argparse.Namespace, size: tuple[int, int]) -> Any:
    """The images (a folder), uploaded one object each, LitData's chunks (local and uploaded),
    and a catalog with the dataset in the bucket and a local copy, and their jobs."""
    import boto3

    from tabloader import catalog
    from tabloader.datagen import make_imagefolder

    folder = make_imagefolder(root / "images", num_images=args.images, size=size, seed=7)
    files = sorted(p for p in folder.rglob("*.jpg"))
    client = boto3.client(
        "s3",
        endpoint_url=server.server_url,
        region_name="us-east-1",
        aws_access_key_id=KEYS[0],
        aws_secret_access_key=KEYS[1],
    )
    client.create_bucket(Bucket=BUCKET)
    keys = [f"objects/{p.relative_to(folder)}" for p in files]
    for key, path in zip(keys, files, strict=True):
        client.upload_file(str(path), BUCKET, key)
    lit = _litdata(root, files, client, args) if "litdata" in args.arms else None
    cat = catalog.open_catalog(root / "cat", create=True)
    cat.import_imagefolder("s3imgs", folder, storage=f"s3://{BUCKET}/tabloader")
    cat.import_imagefolder("localimgs", folder)
    for ds in ("s3imgs", "localimgs"):
        for j in range(4):
            cat.sql(
                f"REGISTER JOB {ds}{j} SELECT image, label FROM {ds} "
                f"WITH (image_size = {args.image_size})"
            )
    return files, keys, lit, cat


def _litdata(root: Path, files: list[Path], client: Any, args: argparse.Namespace) -> Any:
    """LitData's ``optimize`` of the images, uploaded under ``litdata/``; or why not."""
    try:
        from litdata import optimize
    except ImportError as exc:
        return f"litdata not installed ({exc}): pip install litdata 'torch==<yours>'"
    out = root / "litdata"
    log = root / "litdata-optimize.log"
    code = (
        "import sys, pathlib\n"
        "from litdata import optimize\n"
        "def fn(p):\n"
        "    return {'image': pathlib.Path(p).read_bytes(), 'label': 0}\n"
        "if __name__ == '__main__':\n"
        f"    optimize(fn=fn, inputs={[str(f) for f in files]!r}, output_dir={str(out)!r},\n"
        f"             chunk_bytes={args.chunk_bytes!r}, num_workers=1)\n"
    )
    script = root / "optimize_litdata.py"
    script.write_text(code)
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, str(script)], stdout=f, stderr=f, timeout=1200)
    del optimize
    if done.returncode != 0:
        last = (log.read_text().strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"litdata optimize failed: {last}"
    for chunk in sorted(out.iterdir()):
        client.upload_file(str(chunk), BUCKET, f"litdata/{chunk.name}")
    return out


def run(args: argparse.Namespace) -> int:
    """Run every arm; print the table and the target; write JSON."""
    if args.quick:
        args.images, args.size, args.image_size, args.epochs = 48, "96x72", 64, 2
    w, h = (int(v) for v in args.size.split("x"))
    root = Path(tempfile.mkdtemp(prefix="tl-bench-storage-"))
    server = _Server(args.latency)
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": server.url,
        "AWS_ACCESS_KEY_ID": KEYS[0],
        "AWS_SECRET_ACCESS_KEY": KEYS[1],
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "PYTHONPATH": os.pathsep.join([str(root / "site"), *sys.path]),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    try:
        (root / "site").mkdir()
        (root / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        files, keys, lit, cat = _prepare(root, server, args, (w, h))
        data_bytes = sum(p.stat().st_size for p in files)
        results = _arms(root, server, args, env, files, keys, lit, cat, data_bytes)
        # the dataset as tabloader stores it (the images, their labels and paths, in Arrow)
        results["_stored_bytes"] = sum(f.stat().st_size for f in cat.dataset("localimgs").files)
        cat.close()
    finally:
        server.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)
    return _report(results, args, data_bytes, w, h)


def _arms(
    root: Path,
    server: _Server,
    args: argparse.Namespace,
    env: dict[str, str],
    files: list[Path],
    keys: list[str],
    lit: Any,
    cat: Any,
    data_bytes: int,
) -> dict[str, Any]:
    """Each arm of ``args.arms`` and its local reference: name -> its epochs, or why not."""
    base = {
        "image_size": args.image_size,
        "epochs": args.epochs,
        "url": server.url,
        "bucket": BUCKET,
    }
    results: dict[str, Any] = {}
    if "dataloader" in args.arms:
        loader = {**base, "kind": "dataloader"}
        results["DataLoader(2) S3"] = _child(
            server, {**loader, "s3": True, "items": keys}, "objects", env
        )
        local = {**loader, "s3": False, "items": [str(f) for f in files]}
        results["DataLoader(2) local"] = _child(server, local, "objects", env)
    if "litdata" in args.arms and isinstance(lit, Path):
        cfg = {**base, "kind": "litdata", "cache": str(root / "litcache")}
        s3 = {**cfg, "s3": True, "input": f"s3://{BUCKET}/litdata"}
        results["LitData S3"] = _child(server, s3, "litdata", env)
        local = {**cfg, "s3": False, "input": str(lit)}
        results["LitData local"] = _child(server, local, "litdata", env)
    elif "litdata" in args.arms:
        results["LitData S3"] = results["LitData local"] = lit
    if "tabloader" in args.arms:
        results.update(_tabloader_arms(root, server, args, cat, data_bytes))
    return results


def _tabloader_arms(
    root: Path, server: _Server, args: argparse.Namespace, cat: Any, data_bytes: int
) -> dict[str, Any]:
    """One job (tier off) and four (a tier of ``--tier`` times the dataset), from the bucket
    and from the local copy; the arena holds ``--cache`` of the decoded dataset."""
    decoded = args.images * args.image_size**2 * 3
    cache = max(4 << 20, int(args.cache * decoded))
    tier = int(args.tier * data_bytes * 1.1)  # (the part file: the images and their rows)
    ahead = max(1 << 20, int(args.readahead * data_bytes))
    kw = {"cache_bytes": cache, "decode": "processes", "readahead_bytes": ahead}
    results: dict[str, Any] = {}
    for where, ds in (("S3", "s3imgs"), ("local", "localimgs")):
        results[f"tabloader 1 job {where}"] = _tabloader(
            server, cat, [f"{ds}0"], args, "tabloader", storage_cache_bytes=0, **kw
        )
    for where, ds in (("S3", "s3imgs"), ("local", "localimgs")):
        results[f"tabloader 4 jobs {where}"] = _tabloader(
            server,
            cat,
            [f"{ds}{j}" for j in range(4)],
            args,
            "tabloader",
            storage_cache_bytes=tier,
            storage_cache_dir=root / f"tier-{where}",
            **kw,
        )
    results["_tier_bytes"] = tier
    results["_cache_bytes"] = cache
    results["_readahead_bytes"] = ahead
    return results


REFERENCE = {
    "DataLoader(2) S3": "DataLoader(2) local",
    "LitData S3": "LitData local",
    "tabloader 1 job S3": "tabloader 1 job local",
    "tabloader 4 jobs S3": "tabloader 4 jobs local",
}


def _report(
    results: dict[str, Any], args: argparse.Namespace, data_bytes: int, w: int, h: int
) -> int:
    tier, cache = results.pop("_tier_bytes", 0), results.pop("_cache_bytes", 0)
    ahead = results.pop("_readahead_bytes", 0)
    stored = results.pop("_stored_bytes")
    rows: list[dict[str, Any]] = []
    for name, epochs in results.items():
        if isinstance(epochs, str):
            rows.append({"run": name, "epoch": "-", "img/s": "-", "note": epochs[:90]})
            continue
        ref = results.get(REFERENCE.get(name, ""))
        for e, ep in enumerate(epochs):
            ratio = "-"
            if e == len(epochs) - 1 and isinstance(ref, list) and ref and ref[-1]["img_s"]:
                ratio = f"{ep['img_s'] / ref[-1]['img_s']:.2f}"
            rows.append(
                {
                    "run": name,
                    "epoch": e + 1,
                    "s": f"{ep['s']:.2f}",
                    "img/s": f"{ep['img_s']:.0f}",
                    "GETs": ep["gets"],
                    "bytes/dataset": f"{ep['bytes'] / data_bytes:.2f}",
                    "vs local": ratio,
                }
            )
    keys = ["run", "epoch", "s", "img/s", "GETs", "bytes/dataset", "vs local", "note"]
    print(
        f"storage: {args.images} JPEGs of {w}x{h} ({data_bytes:,} bytes) decoded to "
        f"{args.image_size}x{args.image_size}; {args.latency * 1000:.0f} ms added a request; "
        f"tabloader's arena {cache:,} bytes, read-ahead {ahead:,} bytes, 4 jobs' tier {tier:,} "
        f"bytes (1 job: off), its dataset stored in {stored:,} bytes"
    )
    print(cpu_line())
    print(format_table([{k: r.get(k, "") for k in keys} for r in rows], keys))
    checks = _checks(results, stored)
    if checks:
        print(format_table(list(checks), ["check", "ratio", "target", "result"]))
    write_json(
        args.out,
        {
            "images": args.images,
            "size": [w, h],
            "dataset_bytes": data_bytes,
            "latency_s": args.latency,
            "tier_bytes": tier,
            "stored_bytes": stored,
            "arena_bytes": cache,
            "readahead_bytes": ahead,
            "cpu": cpu_line(),
            "results": results,
            "checks": checks,
        },
    )
    return 0


def _checks(results: dict[str, Any], stored: int) -> list[Verdict]:
    """The targets: one job through the latency at ``TARGET`` of its local speed (its last
    epoch, tier off); four jobs over every epoch fetch the stored dataset about once (a tier
    that holds it)."""
    one, local = results.get("tabloader 1 job S3"), results.get("tabloader 1 job local")
    four = results.get("tabloader 4 jobs S3")
    checks = []
    if isinstance(one, list) and isinstance(local, list) and local[-1]["img_s"]:
        ratio = one[-1]["img_s"] / local[-1]["img_s"]
        checks.append(verdict("tabloader 1 job S3 / local (tier off)", ratio, TARGET))
    if isinstance(four, list):
        fetched = sum(ep["bytes"] for ep in four) / stored
        checks.append(
            verdict(
                f"tabloader 4 jobs, {len(four)} epochs: fetched / stored",
                fetched,
                1.15,
                at_most=True,
            )
        )
    return checks


if __name__ == "__main__":
    from benchmarks import main

    main(add_arguments, run, prog="python -m benchmarks storage")
