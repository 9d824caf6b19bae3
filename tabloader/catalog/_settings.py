"""Settings: the one table of the sizes and counts given to tabloader outside a job's options.

Each comes from a flag of ``tabloader serve``, an environment variable or an argument of
``Loader.open``/``JobDataset`` (the job options of ``WITH (...)``, and their values given at open,
are ``tabloader.catalog._options``'s table). ``SETTINGS`` says of each its type, its range (for a
size: the memory it takes, at most this machine's memory, and for the shared cache the size of
``/dev/shm``), its default and where it is read; ``setting()`` reads one and refuses a bad value
with one line naming where it came from, the value and a good one.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tabloader.catalog._errors import CatalogError, TabloaderError

#: The environment variable naming the root that catalogs opened in this process read their
#: parts from (unset: each catalog's own directory; see ``catalog.storage.storage_uri``). Here,
#: not in the storage package, so that a client reads it without importing pyarrow.
STORAGE_ENV = "TABLOADER_STORAGE"

_SHM = "/dev/shm"

DEFAULT_IMAGE_MEGAPIXELS = 64
"""The default pixel limit of an image (``max_image_megapixels``), in megapixels (10^6).

Every consumer camera's full-resolution photo fits (61 MP is the largest full-frame sensor;
phones save 12-50 MP), and one decode of it takes at most 192 MB as RGB (256 MB as CMYK), which
a few decode processes at once can afford on a laptop. Pillow's own limit is 89 MP (a
warning), then 179 MP (an error); datasets of larger images (medical slides, satellite tiles,
medium format) raise it."""
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: int | str, what: str = "memory_limit") -> int:
    """Bytes from an int or a string such as ``'512MB'`` or ``'2 GiB'``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise CatalogError(
            f"{what} {value!r} is not a size; give bytes or a number with a unit, e.g. '2GB'."
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    """``n`` bytes for a message: ``'4.0 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def physical_memory() -> int:
    """This machine's memory in bytes (8 GiB where it cannot be told)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 << 30


def shared_memory() -> int:
    """The most a shared-memory cache may take: the size of ``/dev/shm`` (where there is one),
    at most this machine's memory."""
    try:
        st = os.statvfs(_SHM)
    except OSError:
        return physical_memory()
    return min(physical_memory(), st.f_blocks * st.f_frsize)


@dataclass(frozen=True)
class Setting:
    """One size or count.

    Attributes:
        name: the argument's name (``cache_bytes``).
        kind: ``"bytes"`` (an int, or a number with a unit: ``'2GB'``), ``"count"`` (a whole
            number) or ``"seconds"``.
        help: what it is, for messages.
        minimum: the smallest value.
        maximum: the largest value, or a function of the machine giving it (None: no bound).
        default: the value when none is given or set in ``env``.
        env: the environment variable read when no value is given (None: none).
        flag: the command-line flag that gives it (None: none).
        example: a good value, shown in the fix of an error.
    """

    name: str
    kind: str
    help: str
    minimum: float
    maximum: float | Callable[[], float] | None = None
    default: Any = None
    env: str | None = None
    flag: str | None = None
    example: str = ""

    def bounds(self) -> tuple[float, float]:
        top = self.maximum() if callable(self.maximum) else self.maximum
        return self.minimum, math.inf if top is None else top

    def check(
        self, value: Any, source: str | None = None, error: type[TabloaderError] = CatalogError
    ) -> Any:
        """``value`` typed (int, or float for seconds), or ``error`` naming ``source``
        (default: the name), the value, the range and a good value."""
        where = source or self.name
        low, high = self.bounds()
        show = format_bytes if self.kind == "bytes" else (lambda n: f"{n:g}")
        span = f"from {show(low)}" + ("" if math.isinf(high) else f" to {show(high)}")
        fix = f"{self.help} is {span}, e.g. {self.example}"
        typed = self._typed(value)
        if typed is None:
            what = {"bytes": "a size", "count": "a whole number", "seconds": "a number"}
            raise error(f"{where} {value!r} is not {what[self.kind]}; {fix}.")
        if not low <= typed <= high:
            side = "below" if typed < low else "above"
            raise error(f"{where} {value!r} is {side} the range: {fix}.")
        return typed

    def _typed(self, value: Any) -> Any:
        if isinstance(value, bool):
            return None
        if self.kind != "seconds" and isinstance(value, str) and value.strip().isdigit():
            return int(value)
        if self.kind == "bytes":
            if isinstance(value, int | float) and float(value).is_integer():
                return int(value)
            try:
                return parse_bytes(value) if isinstance(value, str) else None
            except TabloaderError:
                return None
        if self.kind == "count":
            return int(value) if hasattr(value, "__index__") else None
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            return None
        return seconds if math.isfinite(seconds) else None

    def resolve(self, value: Any = None) -> Any:
        """``value`` checked, else the environment's (checked, naming the variable), else
        the default."""
        if value is not None:
            return self.check(value)
        text = os.environ.get(self.env) if self.env else None
        if text:
            return self.check(text, f"${self.env}")
        return self.default


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "cache_bytes",
            "bytes",
            "the shared cache of decoded values (bytes)",
            minimum=1 << 20,
            maximum=shared_memory,
            default=1 << 30,
            env="TABLOADER_CACHE_BYTES",
            flag="--cache-bytes",
            example="'2GiB'",
        ),
        Setting(
            "storage_cache_bytes",
            "bytes",
            "the local storage tier of object storage's bytes, on disk under the catalog's "
            "cache directory (bytes; 0: none)",
            minimum=0,
            default=0,
            env="TABLOADER_STORAGE_CACHE_BYTES",
            flag="--storage-cache-bytes",
            example="'100GiB'",
        ),
        Setting(
            "readahead_bytes",
            "bytes",
            "the record batches of object storage fetched ahead of their decode (bytes)",
            minimum=1 << 20,
            maximum=physical_memory,
            default=64 << 20,
            env="TABLOADER_READAHEAD_BYTES",
            example="'256MiB'",
        ),
        Setting(
            "workers",
            "count",
            "decode processes and reader threads",
            minimum=1,
            maximum=1024,
            flag="--workers",
            example="8",
        ),
        Setting(
            "idle_exit",
            "seconds",
            "seconds a service started by a job waits after its last client",
            minimum=0,
            maximum=365 * 86400,
            default=30.0,
            env="TABLOADER_IDLE_EXIT",
            flag="--idle-exit",
            example="30",
        ),
        Setting(
            "lock_wait",
            "seconds",
            "seconds tabloader.connect, the CLI and a starting service wait for a catalog "
            "that another process holds",
            minimum=0,
            maximum=365 * 86400,
            default=60.0,
            env="TABLOADER_LOCK_WAIT",
            example="120",
        ),
        Setting(
            "memory_limit",
            "bytes",
            "the memory a SQL statement may use",
            minimum=1 << 20,
            maximum=physical_memory,
            env="TABLOADER_MEMORY_LIMIT",
            example="'2GB'",
        ),
        Setting(
            "statement_timeout",
            "seconds",
            "seconds a SQL statement may run",
            minimum=1e-3,
            maximum=365 * 86400,
            default=60.0,
            env="TABLOADER_STATEMENT_TIMEOUT",
            example="60",
        ),
        Setting(
            "max_image_megapixels",
            "count",
            "the most megapixels an image may declare; larger ones are refused before decoding",
            minimum=1,
            maximum=lambda: max(1, physical_memory() // (4 * 10**6)),  # 4 bytes a pixel
            default=DEFAULT_IMAGE_MEGAPIXELS,
            env="TABLOADER_MAX_IMAGE_MEGAPIXELS",
            flag="--max-image-megapixels",
            example="100",
        ),
        Setting(
            "metrics_port",
            "count",
            "the loopback port the service serves Prometheus metrics on (0: any free one)",
            minimum=0,
            maximum=65535,
            flag="--metrics-port",
            example="9464",
        ),
        Setting("prefetch", "count", "batches loaded ahead", minimum=1, maximum=4096, example="4"),
        Setting(
            "lookahead", "count", "rows sampled ahead", minimum=1, maximum=1 << 24, example="256"
        ),
        Setting("epochs", "count", "epochs to read", minimum=1, maximum=1 << 31, example="10"),
        Setting(
            "world_size",
            "count",
            "the data-parallel ranks of a job (at most its rows)",
            minimum=1,
            maximum=4096,
            example="8",
        ),
    )
}


def setting(name: str, value: Any = None) -> Any:
    """Setting ``name``: ``value`` checked, else its environment variable's, else its default.

    Raises:
        CatalogError: the value (or the variable's) is of the wrong type or out of range.
    """
    return SETTINGS[name].resolve(value)


def check_counts(error: type[TabloaderError], **values: Any) -> None:
    """Check each of ``values`` given (not None) as the setting of its name; raise ``error``."""
    for name, value in values.items():
        if value is not None:
            SETTINGS[name].check(value, name, error)
