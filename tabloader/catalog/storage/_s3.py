"""Object storage over the S3 protocol: ``s3://bucket/prefix`` (AWS, MinIO, Ceph, moto...).

The client is obstore (Rust's ``object_store``; the ``s3`` extra: ``pip install
'tabloader[s3]'``), chosen by measurement against pyarrow's ``S3FileSystem``, boto3, minio and
s3fs on loopback (docs/object-storage.md has the table): the least CPU per MB, the most
throughput with many requests in flight, and a 4 ms import (a service's first batch is due
0.5 s after it starts). It is imported at the first request, never at a catalog's open.

**Configuration** comes from the standard AWS environment and files, resolved here (not by
the client, so that a missing credential is one clear error and no request ever goes to an
instance-metadata endpoint): ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (else the
profile's ``endpoint_url``; else AWS), ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` (+
``AWS_SESSION_TOKEN``), else the profile (``AWS_PROFILE``, else ``default``) of
``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``,
``AWS_CONFIG_FILE``); ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else the profile's, else
``us-east-1``; ``AWS_NO_SIGN_REQUEST=true`` for a public bucket.

**Retries** are ours, the same for every request (the client's own are off, so attempts do
not multiply): a 5xx answer (503 SlowDown among them), a connection refused, reset or cut
midway, or a timeout is tried again, ``ATTEMPTS`` times in all, after a full-jitter
exponential backoff (a uniform draw below ``BACKOFF_S * 2**k``, at most ``MAX_BACKOFF_S``);
any other answer (403, 404...) is final. Then a one-line ``StorageError`` names the fix.

**Counters** (``S3Store.counters``, per store, i.e. per URI, in each process): requests,
bytes fetched, retries, checks failed and fetched again (``refetches``), bytes uploaded
(``written``).
"""

from __future__ import annotations

import configparser
import contextlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from tabloader.catalog._errors import StorageError
from tabloader.catalog.storage._ranged import PartFile
from tabloader.catalog.storage._tier import Counters

if TYPE_CHECKING:
    from tabloader.catalog.storage._tier import BatchCache

ATTEMPTS = 5  # tries of one request in all (4 retries: ~0.75 s of backoff at most on average)
BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0
IN_FLIGHT = 16  # requests in flight at once per store (threads; each blocks in Rust, GIL free)
CONNECT_TIMEOUT = "5s"
REQUEST_TIMEOUT = "60s"
INSTALL_FIX = "Install the S3 client: pip install 'tabloader[s3]' (obstore)."
_T = TypeVar("_T")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def split_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` as ``(bucket, prefix)`` (the prefix without slashes at its ends).

    Raises:
        StorageError: not an ``s3://`` URI with a valid bucket name.
    """
    scheme, _, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme.lower() != "s3" or not _BUCKET.fullmatch(bucket):
        raise StorageError(
            f"{uri!r} is not an S3 location; write s3://bucket/prefix (a bucket name of 3-63 "
            "lowercase letters, digits, dots and hyphens).",
            path=uri,
        )
    return bucket, prefix.strip("/")


@dataclass(frozen=True)
class S3Config:
    """Where and as whom requests go (``s3_config``)."""

    endpoint: str | None
    region: str
    access_key_id: str | None
    secret_access_key: str | None
    session_token: str | None
    anonymous: bool
    source: str  # where the credentials came from, for messages

    @property
    def where(self) -> str:
        return self.endpoint or f"AWS S3 ({self.region})"


def _profile_sections(environ: dict[str, str] | os._Environ[str]) -> tuple[str, dict[str, str]]:
    """The profile's name and its keys in ``~/.aws/credentials`` and ``~/.aws/config``."""
    profile = environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(environ.get("HOME") or Path.home())
    files = (
        (environ.get("AWS_CONFIG_FILE") or str(home / ".aws/config"), True),
        (environ.get("AWS_SHARED_CREDENTIALS_FILE") or str(home / ".aws/credentials"), False),
    )
    keys: dict[str, str] = {}
    for path, is_config in files:  # the credentials file's keys win over the config's
        parser = configparser.RawConfigParser()
        with contextlib.suppress(OSError, configparser.Error):
            parser.read(path)
        section = f"profile {profile}" if is_config and profile != "default" else profile
        if parser.has_section(section):
            keys.update({k.lower(): v.strip() for k, v in parser.items(section)})
    return profile, keys


def s3_config(environ: dict[str, str] | os._Environ[str] | None = None) -> S3Config:
    """The endpoint, region and credentials of the AWS environment (see the module)."""
    env = os.environ if environ is None else environ
    profile, keys = _profile_sections(env)
    key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    token = env.get("AWS_SESSION_TOKEN")
    source = "AWS_ACCESS_KEY_ID"
    if not (key_id and secret):
        key_id, secret = keys.get("aws_access_key_id"), keys.get("aws_secret_access_key")
        token, source = keys.get("aws_session_token"), f"profile '{profile}'"
    endpoint = (
        env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or keys.get("endpoint_url")
    )
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or keys.get("region")
    return S3Config(
        endpoint=endpoint.rstrip("/") if endpoint else None,
        region=region or "us-east-1",
        access_key_id=key_id or None,
        secret_access_key=secret or None,
        session_token=token or None,
        anonymous=env.get("AWS_NO_SIGN_REQUEST", "").lower() in ("1", "true", "yes"),
        source=source,
    )


@dataclass
class StoreCounters(Counters[int]):
    """What a store fetched."""

    requests: int = 0
    bytes: int = 0  # fetched
    retries: int = 0
    refetches: int = 0
    written: int = 0  # uploaded


class _Final(Exception):
    """An answer that no retry changes (wraps the client's error)."""


# -- one boundary for the client's errors --------------------------------------------------------
_TRANSIENT = re.compile(
    r"\b5\d\d\b|SlowDown|Service ?Unavailable|InternalError|timed? ?out|connection|"
    r"connect|reset|broken pipe|closed|incomplete|body|EOF|unexpected end",
    re.IGNORECASE,
)


def _status(text: str) -> int | None:
    """The HTTP status an error's text reports (the client's "status code: 503"), if any."""
    m = re.search(r"status code: (\d{3})", text)
    return int(m.group(1)) if m else None


class S3Store:
    """The parts of datasets under ``s3://bucket/prefix`` (a ``Store``, and the ranged reads of
    a ``RangedStore``: :mod:`tabloader.catalog.storage._stores`), and the objects of sources
    there.

    One per URI per process (``open_s3``): its connections, thread pool, open parts and
    counters are shared by every reader of that URI. Nothing is requested before the first
    read.
    """

    def __init__(self, uri: str) -> None:
        self.bucket, self.prefix = split_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.counters = StoreCounters()
        self._client: Any = None
        self._config: S3Config | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._parts: dict[tuple[str, int], PartFile] = {}
        self._opening: dict[tuple[str, int], threading.Lock] = {}
        self._lock = threading.Lock()

    # -- names ------------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        """The object key of ``name`` (a path under the prefix)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def locate(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    # -- the client -------------------------------------------------------------------------------
    def _store(self) -> Any:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._connect()
        return self._client

    def _connect(self) -> Any:
        try:
            from obstore.store import S3Store as Client
        except ImportError:
            raise StorageError(f"Cannot read {self.uri}: no S3 client. {INSTALL_FIX}") from None
        cfg = self._config = s3_config()
        if not cfg.anonymous and not (cfg.access_key_id and cfg.secret_access_key):
            raise StorageError(
                f"No S3 credentials for {self.uri}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile of ~/.aws/credentials "
                "(AWS_NO_SIGN_REQUEST=true for a public bucket).",
                path=self.uri,
            )
        config: dict[str, Any] = {"region": cfg.region, "virtual_hosted_style_request": False}
        if cfg.anonymous:
            config["skip_signature"] = True
        else:
            config["access_key_id"] = cfg.access_key_id
            config["secret_access_key"] = cfg.secret_access_key
            if cfg.session_token:
                config["session_token"] = cfg.session_token
        if cfg.endpoint:
            config["endpoint"] = cfg.endpoint
        options = {
            "allow_http": bool(cfg.endpoint and cfg.endpoint.startswith("http://")),
            "connect_timeout": CONNECT_TIMEOUT,
            "timeout": REQUEST_TIMEOUT,
        }
        client: Any = Client  # (typed loosely: obstore is an optional dependency)
        return client(
            self.bucket, config=config, client_options=options, retry_config={"max_retries": 0}
        )

    def _message(self, exc: BaseException, what: str) -> str:
        """The one line that says what failed and the fix, for the client's error ``exc``."""
        cfg = self._config or s3_config()
        text = " ".join(str(exc).split())
        short = text[:300]
        name = type(exc).__name__
        if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
            return (
                f"{what}: bucket '{self.bucket}' does not exist at {cfg.where}. Create it, or "
                "fix the bucket's name (and AWS_ENDPOINT_URL if it lives elsewhere)."
            )
        if name == "UnauthenticatedError" or re.search(
            r"InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken", text
        ):
            return (
                f"{what}: {cfg.where} refused the credentials of {cfg.source} ({short}). Fix "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the profile."
            )
        if (
            isinstance(exc, PermissionError)
            or name == "PermissionDeniedError"
            or _status(text) == 403
        ):
            return (
                f"{what}: access denied to {cfg.source}'s credentials at {cfg.where}. Grant "
                f"them s3:GetObject, s3:PutObject and s3:ListBucket on s3://{self.bucket}/"
                f"{self.prefix}, or use a location they may write."
            )
        status = _status(text)
        if status is not None and status >= 500:
            return (
                f"{what}: {cfg.where} answered {status} to {ATTEMPTS} attempts ({short}); the "
                "server is overloaded or failing: try again later."
            )
        if status is None and _TRANSIENT.search(text):
            return (
                f"{what}: the S3 endpoint {cfg.where} did not answer after {ATTEMPTS} attempts "
                f"({short}). Check AWS_ENDPOINT_URL and that the server runs."
            )
        return f"{what} failed: {name}: {short}."

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()`` (one request), retried while it fails transiently (see the module)."""
        for attempt in range(ATTEMPTS):
            try:
                self.counters.add(requests=1)
                return fn()
            except Exception as exc:
                if not self._transient(exc) or attempt == ATTEMPTS - 1:
                    if isinstance(exc, FileNotFoundError) and "NoSuchBucket" not in str(exc):
                        raise FileNotFoundError(what) from exc
                    raise StorageError(self._message(exc, what), path=self.uri) from exc
                self.counters.add(retries=1)
                time.sleep(random.uniform(0, min(MAX_BACKOFF_S, BACKOFF_S * 2**attempt)))
        raise AssertionError("unreachable")

    @staticmethod
    def _transient(exc: BaseException) -> bool:
        """Whether another try may succeed: a 5xx answer, or no (whole) answer at all."""
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            return False
        final = ("PermissionDeniedError", "UnauthenticatedError", "PreconditionError")
        if type(exc).__name__ in (*final, "AlreadyExistsError", "InvalidPathError"):
            return False
        text = str(exc)
        status = _status(text)
        if status is not None:
            return status >= 500
        return bool(_TRANSIENT.search(text))

    def _in_flight(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="tabloader-s3")
        return self._pool

    def release_threads(self) -> None:
        """End the threads of the requests in flight (started again at the next read)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- reads ------------------------------------------------------------------------------------
    def read_range(self, name: str, offset: int, length: int) -> Any:
        """Bytes ``[offset, offset + length)`` of object ``name`` in one request (retried; a
        short answer, a body cut midway, is retried too).

        Raises:
            FileNotFoundError: no such object. StorageError: see the module.
        """
        import obstore

        store, key = self._store(), self.key(name)

        def get() -> Any:
            data = obstore.get_range(store, key, start=offset, length=length)
            if len(data) != length:
                raise ConnectionError(f"incomplete body: {len(data)} of {length} bytes")
            return data

        data = self._call(f"Reading {self.locate(name)}", get)
        self.counters.add(bytes=length)
        return data

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """The ``(offset, length)`` ranges of object ``name``, each in one request, up to
        ``IN_FLIGHT`` of them in flight (this store's pool, shared by its readers)."""
        if len(ranges) == 1:
            return [self.read_range(name, *ranges[0])]
        pool = self._in_flight()
        return list(pool.map(lambda r: self.read_range(name, r[0], r[1]), ranges))

    def read_object(self, name: str) -> bytes:
        """Object ``name`` whole (one request, retried)."""
        import obstore

        store, key = self._store(), self.key(name)
        data = self._call(f"Reading {self.locate(name)}", lambda: obstore.get(store, key).bytes())
        self.counters.add(bytes=len(data))
        return bytes(data)

    def read_objects(self, names: Sequence[str]) -> list[bytes]:
        """Objects ``names`` whole, up to ``IN_FLIGHT`` requests in flight."""
        return list(self._in_flight().map(self.read_object, names))

    def part(self, name: str, *, size: int, what: str, cache: BatchCache | None = None) -> PartFile:
        """Part ``name`` (of ``size`` bytes) for ranged reads: its footer fetched once (with
        its tail; from ``cache`` where it holds it) and shared by every reader of it in this
        process.

        Raises:
            FileNotFoundError: no such object. StorageError: see ``PartFile``.
        """
        part = self._parts.get((name, size))
        if part is not None:
            part.keep_tail(cache)
            return part
        with self._lock:  # one opening per part: readers that ask meanwhile wait for it
            opening = self._opening.setdefault((name, size), threading.Lock())
        with opening:
            part = self._parts.get((name, size))
            if part is None:
                part = PartFile(
                    lambda ranges: self.read_ranges(name, ranges),
                    size,
                    what,
                    name=name,
                    uri=self.uri,
                    cache=cache,
                )
                self._parts[(name, size)] = part
        part.keep_tail(cache)  # (one opened meanwhile by a reader without this cache)
        return part

    def open_part(self, name: str, *, size: int, what: str, memory_map: bool) -> pa.NativeFile:
        """Part ``name`` as a random-access file (never a map: its reads are copies)."""
        return self.part(name, size=size, what=what).file()

    def size_of(self, name: str) -> int | None:
        """The size of object ``name``; None if there is none."""
        import obstore

        store, key = self._store(), self.key(name)
        try:
            meta = self._call(f"Reading {self.locate(name)}", lambda: obstore.head(store, key))
        except FileNotFoundError:
            return None
        return int(meta["size"])

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(name, size)`` of the objects under ``prefix`` (a path under this store's),
        sorted by name; names relative to this store's prefix."""
        import obstore

        store = self._store()
        full = self.key(prefix).rstrip("/")

        def listed() -> list[tuple[str, int]]:
            found = []
            for chunk in obstore.list(store, full or None):
                found += [(m["path"], int(m["size"])) for m in chunk]
            return found

        found = self._call(f"Listing s3://{self.bucket}/{full}", listed)
        cut = len(self.prefix) + 1 if self.prefix else 0
        return sorted((p[cut:], n) for p, n in found)

    # -- writes -----------------------------------------------------------------------------------
    def upload(self, name: str, path: Path) -> None:
        """Write the local file ``path`` as object ``name``: whole or not at all (a multipart
        upload is invisible until complete), retried as a whole."""
        import obstore

        store, key = self._store(), self.key(name)
        size = path.stat().st_size
        self._call(f"Writing {self.locate(name)}", lambda: obstore.put(store, key, path))
        self.counters.add(written=size)

    def put(self, name: str, data: bytes) -> None:
        """Write ``data`` as object ``name`` (small objects)."""
        import obstore

        store, key = self._store(), self.key(name)
        self._call(f"Writing {self.locate(name)}", lambda: obstore.put(store, key, data))

    def delete(self, name: str) -> None:
        """Delete object ``name`` (nothing if it does not exist)."""
        import obstore

        store, key = self._store(), self.key(name)
        with contextlib.suppress(FileNotFoundError):
            self._call(f"Deleting {self.locate(name)}", lambda: obstore.delete(store, key))

    def check_writable(self, name: str) -> None:
        """Write and delete a small object ``name``: a bucket that refuses writes (or does not
        exist) fails here, before an import spends its time.

        Raises:
            StorageError: naming the fix.
        """
        self.put(name, b"tabloader write check\n")
        self.delete(name)


_STORES: dict[str, S3Store] = {}
_STORES_LOCK = threading.Lock()


def open_s3(uri: str) -> S3Store:
    """The store of ``uri`` in this process (one per URI: see ``S3Store``)."""
    bucket, prefix = split_uri(uri)
    canonical = f"s3://{bucket}/{prefix}".rstrip("/")
    with _STORES_LOCK:
        store = _STORES.get(canonical)
        if store is None:
            store = _STORES[canonical] = S3Store(canonical)
        return store


def forget_stores() -> None:
    """Drop this process's stores (their clients read the environment again when next
    opened: tests that change it); their threads end once their requests in flight are done."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
        _STORES.clear()
    for store in stores:
        store.release_threads()
