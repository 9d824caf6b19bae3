"""Which S3 client reads a dataset's byte ranges: measured on loopback, not the suite.

    python scripts/s3_clients.py [--clients pyarrow,obstore,boto3,minio,s3fs] [--out FILE]

Each client runs in a fresh process against two loopback servers, both started by this script
in a process of their own (so their CPU is not the client's):

* ``moto``: moto's server mode (``ThreadedMotoServer``), behind tests/support/s3proxy.py for
  the added latency. Moto spends ~6 ms of CPU on every ranged GET (it copies the object), so
  with requests in flight it, not the client, sets the pace.
* ``static``: a minimal threaded HTTP server of this script that answers path-style GET/HEAD
  (with ``Range``) and PUT from memory, sleeping the added latency itself: ~0.2 ms of CPU a
  request, so the clients' own costs show.

Per client: the import's time (after pyarrow and numpy, which every tabloader process has),
the time from constructing the client to its first ranged GET's bytes (a cold start: SDK
initialization, credentials), the median latency of one 100 KB ranged GET at a time, the
throughput with 32 ranged GETs in flight, and the client process's CPU (user + system) per
MB read. Clients not installed are skipped (minio and s3fs are not dependencies of
tabloader: ``pip install --target DIR minio s3fs`` and ``PYTHONPATH=DIR`` for them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bench"
OBJECTS = 32  # objects of OBJECT_BYTES, read in RANGE_BYTES ranges
OBJECT_BYTES = 1 << 20
RANGE_BYTES = 100_000
SERIAL = 60  # ranged GETs one at a time (latency)
CONCURRENT = 600  # ranged GETs, IN_FLIGHT at a time (throughput, CPU)
IN_FLIGHT = 32
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench-secret",
    "AWS_REGION": "us-east-1",
}


# -- servers (run in their own process: ``serve``) ---------------------------------------------
class _Static(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    objects: dict[str, bytes] = {}  # noqa: RUF012 (the server's one store)
    latency = 0.0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_PUT(self) -> None:  # (a bucket, or an object)
        n = int(self.headers.get("Content-Length", 0))
        self.objects[self.path.split("?")[0]] = self.rfile.read(n)
        self._send(200, b"", {"ETag": '"0"'})

    def do_GET(self) -> None:
        time.sleep(self.latency)
        data = self.objects.get(self.path.split("?")[0])
        if data is None:
            return self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", {})
        headers = {"ETag": '"0"', "Last-Modified": "Mon, 07 Dec 2026 00:00:00 GMT"}
        headers["Content-Type"] = "application/octet-stream"
        spec = self.headers.get("Range")
        if spec is None:
            return self._send(200, data, headers)
        first, _, last = spec.removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        return self._send(206, data[start:end], headers)

    do_HEAD = do_GET


def serve(latency: float) -> None:
    """Start both servers, print their endpoints as JSON, and serve until stdin closes."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.s3proxy import Faults, loopback_s3

    _Static.latency = latency
    static = ThreadingHTTPServer(("127.0.0.1", 0), _Static)
    static.daemon_threads = True
    threading.Thread(target=static.serve_forever, daemon=True).start()
    with loopback_s3(Faults(latency=latency)) as s3:
        endpoints = {"moto": s3.url, "static": f"http://127.0.0.1:{static.server_port}"}
        print(json.dumps(endpoints), flush=True)
        sys.stdin.read()
    static.shutdown()


def fill(endpoint: str) -> None:
    """Create the bucket and its objects (with boto3, as the fixture does)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, **_boto_credentials())
    client.create_bucket(Bucket=BUCKET)
    payload = os.urandom(OBJECT_BYTES)
    for i in range(OBJECTS):
        client.put_object(Bucket=BUCKET, Key=f"obj/{i:03d}", Body=payload)


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDENTIALS["AWS_REGION"],
    }


# -- clients (each run in a fresh process: ``client NAME ENDPOINT``) ---------------------------
def _ranges(n: int, seed: int) -> list[tuple[str, int]]:
    import random

    rng = random.Random(seed)
    per = OBJECT_BYTES // RANGE_BYTES
    return [
        (f"obj/{rng.randrange(OBJECTS):03d}", rng.randrange(per) * RANGE_BYTES) for _ in range(n)
    ]


def _reader(name: str, endpoint: str):
    """``read(key, offset, length) -> bytes`` of client ``name``, and a concurrent
    ``read_many(list of (key, offset), length) -> bytes read``."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(IN_FLIGHT)

    def threaded(read):
        def read_many(ranges, length):
            return sum(len(b) for b in pool.map(lambda r: read(r[0], r[1], length), ranges))

        return read_many

    if name == "pyarrow":
        from pyarrow import fs

        s3 = fs.S3FileSystem(
            endpoint_override=endpoint,
            scheme="http",
            access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region=CREDENTIALS["AWS_REGION"],
        )
        files: dict[str, object] = {}
        lock = threading.Lock()

        def read(key, offset, length):
            f = files.get(key)
            if f is None:
                with lock:
                    f = files.get(key) or files.setdefault(
                        key, s3.open_input_file(f"{BUCKET}/{key}")
                    )
            return f.read_at(length, offset)

        return read, threaded(read)
    if name == "obstore":
        import asyncio

        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            endpoint=endpoint,
            access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region=CREDENTIALS["AWS_REGION"],
            client_options={"allow_http": True},
        )

        def read(key, offset, length):
            return obstore.get_range(store, key, start=offset, length=length)

        async def gather(ranges, length):
            sem = asyncio.Semaphore(IN_FLIGHT)

            async def one(key, offset):
                async with sem:
                    got = await obstore.get_range_async(store, key, start=offset, length=length)
                    return len(got)

            return sum(await asyncio.gather(*(one(k, o) for k, o in ranges)))

        return read, lambda ranges, length: asyncio.run(gather(ranges, length))
    if name == "boto3":
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            config=Config(max_pool_connections=IN_FLIGHT),
            **_boto_credentials(),
        )

        def read(key, offset, length):
            rng = f"bytes={offset}-{offset + length - 1}"
            return client.get_object(Bucket=BUCKET, Key=key, Range=rng)["Body"].read()

        return read, threaded(read)
    if name == "minio":
        import urllib3
        from minio import Minio

        mc = Minio(
            endpoint.removeprefix("http://"),
            access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region=CREDENTIALS["AWS_REGION"],
            secure=False,
            http_client=urllib3.PoolManager(maxsize=IN_FLIGHT),
        )

        def read(key, offset, length):
            r = mc.get_object(BUCKET, key, offset=offset, length=length)
            try:
                return r.read()
            finally:
                r.close()
                r.release_conn()

        return read, threaded(read)
    if name == "s3fs":
        import s3fs

        fs3 = s3fs.S3FileSystem(
            key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=endpoint,
            client_kwargs={"region_name": CREDENTIALS["AWS_REGION"]},
            max_concurrency=IN_FLIGHT,
        )

        def read(key, offset, length):
            return fs3.cat_file(f"{BUCKET}/{key}", start=offset, end=offset + length)

        def read_many(ranges, length):
            got = fs3.cat_ranges(
                [f"{BUCKET}/{k}" for k, _ in ranges],
                [o for _, o in ranges],
                [o + length for _, o in ranges],
                batch_size=IN_FLIGHT,
            )
            return sum(len(b) for b in got)

        return read, read_many
    raise SystemExit(f"unknown client {name}")


def client(name: str, endpoint: str) -> None:
    """Measure client ``name`` against ``endpoint``; print one JSON line."""
    import numpy  # noqa: F401  (every tabloader process has them: not the client's cost)
    import pyarrow  # noqa: F401

    os.environ.update(CREDENTIALS)
    t0 = time.perf_counter()
    read, read_many = _reader(name, endpoint)
    first = read("obj/000", 0, RANGE_BYTES)
    t1 = time.perf_counter()
    assert len(first) == RANGE_BYTES, len(first)
    latencies = []
    for key, offset in _ranges(SERIAL, 1):
        s = time.perf_counter()
        assert len(read(key, offset, RANGE_BYTES)) == RANGE_BYTES
        latencies.append(time.perf_counter() - s)
    latencies.sort()
    read_many(_ranges(IN_FLIGHT, 3), RANGE_BYTES)  # connections opened
    c0, w0 = os.times(), time.perf_counter()
    got = read_many(_ranges(CONCURRENT, 2), RANGE_BYTES)
    c1, w1 = os.times(), time.perf_counter()
    assert got == CONCURRENT * RANGE_BYTES, got
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    mb = got / 1e6
    result = {
        "first_ms": (t1 - t0) * 1e3,
        "latency_ms": latencies[len(latencies) // 2] * 1e3,
        "mb_s": mb / (w1 - w0),
        "cpu_ms_per_mb": cpu * 1e3 / mb,
    }
    print(json.dumps(result))
    os._exit(0)  # (s3fs's loop thread and pyarrow's S3 finalizer make a slow exit)


IMPORTS = {
    "pyarrow": "pyarrow.fs",
    "obstore": "obstore",
    "boto3": "boto3",
    "minio": "minio",
    "s3fs": "s3fs",
}


def import_ms(name: str) -> float | None:
    """The import's time in a fresh process that has pyarrow and numpy already (best of 3)."""
    code = (
        f"import numpy, pyarrow, time; t = time.perf_counter(); import {IMPORTS[name]}; "
        "print((time.perf_counter() - t) * 1e3)"
    )
    best = None
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if done.returncode != 0:
            return None
        ms = float(done.stdout)
        best = ms if best is None else min(best, ms)
    return best


def measure(clients: list[str], latency: float) -> dict[str, dict[str, float]]:
    """Every client against both servers with ``latency`` seconds added per request."""
    server = subprocess.Popen(
        [sys.executable, __file__, "serve", str(latency)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        endpoints = json.loads(server.stdout.readline())
        results: dict[str, dict[str, float]] = {}
        for kind, endpoint in endpoints.items():
            fill(endpoint)
            for name in clients:
                done = subprocess.run(
                    [sys.executable, __file__, "client", name, endpoint],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if done.returncode != 0:
                    print(f"{name} on {kind}: {done.stderr.strip()[-300:]}", file=sys.stderr)
                    continue
                for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    results.setdefault(name, {})[f"{kind}_{k}"] = v
        return results
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)


def table(clients: list[str]) -> str:
    fast = measure(clients, 0.0)
    slow = measure(clients, 0.010)
    head = (
        "| client | import ms | first GET ms | GET ms (+0 / +10 ms) | MB/s, 32 in flight, +10 ms "
        "(static / moto) | MB/s +0 ms static | client CPU ms/MB (static +0) |"
    )
    lines = [head, "|" + " --- |" * 7]
    for name in clients:
        if name not in fast:
            continue
        f, s = fast[name], slow.get(name, {})
        imp = import_ms(name)
        lines.append(
            f"| {name} | {imp:.0f} | {f.get('static_first_ms', float('nan')):.0f} | "
            f"{f.get('static_latency_ms', float('nan')):.1f} / "
            f"{s.get('static_latency_ms', float('nan')):.1f} | "
            f"{s.get('static_mb_s', float('nan')):.0f} / {s.get('moto_mb_s', float('nan')):.0f} | "
            f"{f.get('static_mb_s', float('nan')):.0f} | "
            f"{f.get('static_cpu_ms_per_mb', float('nan')):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve(float(sys.argv[2]))
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        return client(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", default="pyarrow,obstore,boto3,minio,s3fs")
    args = parser.parse_args()
    print(table(args.clients.split(",")))
    return None


if __name__ == "__main__":
    main()
