"""The service's figures in Prometheus' text exposition format, and a loopback endpoint for them.

:func:`render_metrics` turns the service's counters (``Loader.stats()`` with its ``clients``,
what ``tabloader status --json`` shows) into the text format 0.0.4 that a Prometheus server
scrapes: ``# HELP`` and ``# TYPE`` lines, then one sample per line, counters named
``..._total``, seconds and bytes in the name (``_seconds_total``, ``_bytes``), label values
escaped (``\\``, ``"`` and newlines). Every metric, its type, labels and meaning:
``docs/metrics.md`` (a test checks it lists every entry of :data:`METRICS`).

* per job (labels ``job``, ``dataset``) and per rank of it (``job``, ``dataset``, ``rank``; a
  job that is not data-parallel has rank 0): rows and batches delivered, the seconds the
  training loop waited for batches (``wait``) and spent between them (``compute``), the
  seconds the service spent on its own augmentation, and the stall fraction
  ``wait / (wait + compute)``. A rank's process measures its waits itself and sends them with
  its next request, so they lag by one batch.
* per dataset (``dataset``): reads, decodes and bytes read from storage, and the seconds of the
  engine's workers by stage (``stage`` = read, decode, collate, augment);
* the cache: its capacity and bytes in use, values, pinned values, hits, misses, evictions;
  the client processes connected.

Counters start when the service (a job's: when the job) opens; a job that closes goes, and comes
back from 0 when it opens again (a counter reset, which ``rate()`` handles).

:class:`MetricsServer` serves the text at ``http://127.0.0.1:PORT/metrics`` from a thread of the
service (``tabloader serve --metrics-port PORT``): loopback only, GET only, the figures of the
moment of each request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # imported by MetricsServer: http.server brings ssl, 10-40 ms of every
    import http.server  # service's start, which seldom serves metrics

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metric(NamedTuple):
    """One metric family: its name, labels and meaning (its HELP line)."""

    name: str
    labels: tuple[str, ...]
    help: str

    @property
    def type(self) -> str:
        """Its Prometheus type, which its name says: a counter's ends ``_total``, as the
        format asks; every other family here is a gauge."""
        return "counter" if self.name.endswith("_total") else "gauge"


_JOB = ("job", "dataset")
_RANK = ("job", "dataset", "rank")
_STAGES = ("read", "decode", "collate", "augment")

METRICS: tuple[Metric, ...] = (
    Metric("tabloader_service_up", (), "1 while a loader service serves the catalog"),
    Metric("tabloader_clients", (), "Client processes connected to the service"),
    Metric("tabloader_job_rows_total", _JOB, "Rows delivered to the job, all its ranks"),
    Metric("tabloader_job_batches_total", _JOB, "Batches delivered to the job"),
    Metric(
        "tabloader_job_wait_seconds_total",
        _JOB,
        "Seconds the job's training loops waited for batches (the copy out included)",
    ),
    Metric(
        "tabloader_job_compute_seconds_total",
        _JOB,
        "Seconds the job's training loops spent between batches (their own work)",
    ),
    Metric(
        "tabloader_job_augment_seconds_total",
        _JOB,
        "Seconds the service's threads spent on the job's own augmentation",
    ),
    Metric(
        "tabloader_job_stall_fraction",
        _JOB,
        "Share of the job's loop time spent waiting for batches: wait / (wait + compute)",
    ),
    Metric("tabloader_job_epoch", _JOB, "The epoch the job reads now (from 0)"),
    Metric("tabloader_job_skipped_rows_total", _JOB, "Rows left out: failed to read"),
    Metric(
        "tabloader_job_shared_values_total",
        _JOB,
        "Values another job's read or decode served (cached or in flight)",
    ),
    Metric("tabloader_rank_rows_total", _RANK, "Rows delivered to the rank"),
    Metric("tabloader_rank_batches_total", _RANK, "Batches delivered to the rank"),
    Metric(
        "tabloader_rank_wait_seconds_total",
        _RANK,
        "Seconds the rank's training loop waited for batches",
    ),
    Metric(
        "tabloader_rank_compute_seconds_total",
        _RANK,
        "Seconds the rank's training loop spent between batches",
    ),
    Metric(
        "tabloader_rank_stall_fraction",
        _RANK,
        "Share of the rank's loop time spent waiting for batches: wait / (wait + compute)",
    ),
    Metric("tabloader_reads_total", ("dataset",), "Payload values read from storage"),
    Metric("tabloader_decodes_total", ("dataset",), "Images decoded"),
    Metric("tabloader_storage_read_bytes_total", ("dataset",), "Bytes read from storage"),
    Metric(
        "tabloader_stage_seconds_total",
        ("dataset", "stage"),
        "Seconds of the engine's workers by stage: read, decode, collate (the copy into the "
        "jobs' batches), augment (of collate)",
    ),
    Metric("tabloader_cache_capacity_bytes", (), "Bytes of the shared cache"),
    Metric("tabloader_cache_bytes", (), "Bytes of the cache holding values"),
    Metric("tabloader_cache_values", (), "Values (decoded images) in the cache"),
    Metric("tabloader_cache_pinned_values", (), "Values held by batches in flight"),
    Metric("tabloader_cache_hits_total", (), "Look-ups that found their value"),
    Metric("tabloader_cache_misses_total", (), "Look-ups that had to read it"),
    Metric("tabloader_cache_evictions_total", (), "Values evicted from the cache"),
)
_BY_NAME = {m.name: m for m in METRICS}


def escape(value: object) -> str:
    """A label value as the text format writes it.

    Example:
        >>> escape('a "b"\\\\c\\nd')
        'a \\\\"b\\\\"\\\\\\\\c\\\\nd'
    """
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def _stall(stats: Mapping[str, Any]) -> float:
    busy = float(stats["wait_s"]) + float(stats["compute_s"])
    return float(stats["wait_s"]) / busy if busy > 0 else 0.0


def _loop_samples(
    scope: str, labels: dict[str, Any], stats: Mapping[str, Any]
) -> Iterable[tuple[str, dict[str, Any], float]]:
    """The samples a job and each of its ranks both have (``scope``: job or rank): rows and
    batches delivered, the loop's wait and compute seconds, its stall fraction."""
    yield f"tabloader_{scope}_rows_total", labels, stats["rows"]
    yield f"tabloader_{scope}_batches_total", labels, stats["batches"]
    yield f"tabloader_{scope}_wait_seconds_total", labels, stats["wait_s"]
    yield f"tabloader_{scope}_compute_seconds_total", labels, stats["compute_s"]
    yield f"tabloader_{scope}_stall_fraction", labels, _stall(stats)


def _samples(stats: Mapping[str, Any] | None) -> Iterable[tuple[str, dict[str, Any], float]]:
    """(metric, labels, value) of every sample of ``stats`` (None: no service)."""
    yield "tabloader_service_up", {}, int(stats is not None)
    if stats is None:
        return
    yield "tabloader_clients", {}, len(stats.get("clients", ()))
    for name, job in sorted(stats["jobs"].items()):
        labels = {"job": name, "dataset": job["dataset"]}
        yield from _loop_samples("job", labels, job)
        yield "tabloader_job_augment_seconds_total", labels, job["augment_s"]
        yield "tabloader_job_epoch", labels, job["epoch"]
        yield "tabloader_job_skipped_rows_total", labels, job["skipped"]
        yield "tabloader_job_shared_values_total", labels, job["shared"]
        for rank in job.get("ranks") or [job]:
            yield from _loop_samples("rank", {**labels, "rank": rank["rank"]}, rank)
    for name, counters in sorted(stats["datasets"].items()):
        at = {"dataset": name}
        yield "tabloader_reads_total", at, counters["reads"]
        yield "tabloader_decodes_total", at, counters["decodes"]
        yield "tabloader_storage_read_bytes_total", at, counters["bytes_read"]
        for stage in _STAGES:
            yield "tabloader_stage_seconds_total", {**at, "stage": stage}, counters[f"{stage}_s"]
    cache = stats["cache"]
    yield "tabloader_cache_capacity_bytes", {}, cache["capacity_bytes"]
    yield "tabloader_cache_bytes", {}, cache["size_bytes"]
    yield "tabloader_cache_values", {}, cache["entries"]
    yield "tabloader_cache_pinned_values", {}, cache["pinned"]
    yield "tabloader_cache_hits_total", {}, cache["hits"]
    yield "tabloader_cache_misses_total", {}, cache["misses"]
    yield "tabloader_cache_evictions_total", {}, cache["evictions"]


def render_metrics(stats: Mapping[str, Any] | None) -> str:
    """The text format of the service's ``stats`` (``Loader.stats()`` and ``clients``; None:
    no service runs, only ``tabloader_service_up 0``), each family with its HELP and TYPE.

    Example:
        >>> print(render_metrics(None))
        # HELP tabloader_service_up 1 while a loader service serves the catalog
        # TYPE tabloader_service_up gauge
        tabloader_service_up 0
        <BLANKLINE>
    """
    families: dict[str, list[str]] = {}
    for name, labels, value in _samples(stats):
        metric = _BY_NAME[name]
        assert tuple(labels) == metric.labels, (name, labels)  # the table says every label
        shown = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
        sample = f"{name}{{{shown}}}" if shown else name
        families.setdefault(name, []).append(f"{sample} {_number(value)}")
    lines = []
    for metric in METRICS:
        if metric.name in families:
            lines.append(f"# HELP {metric.name} {metric.help}")
            lines.append(f"# TYPE {metric.name} {metric.type}")
            lines += families[metric.name]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """``render()``'s text at ``http://127.0.0.1:port/metrics``, served by a daemon thread.

    Args:
        port: the loopback port (0: any free one; ``port`` then says which).
        render: the text of the moment (called for each request, in the server's thread).

    Raises:
        ServiceError: the port is taken (or not ours to take).
    """

    def __init__(self, port: int, render: Callable[[], str]) -> None:
        import http.server

        from tabloader.catalog._errors import ServiceError

        handler = _handler(render)
        try:
            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError as exc:
            raise ServiceError(
                f"Cannot serve metrics on 127.0.0.1:{port} ({exc.strerror or exc}); pass "
                "another --metrics-port (0: any free port)."
            ) from None
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="tabloader-metrics", daemon=True
        )
        self._thread.start()
        logger.info("metrics at http://127.0.0.1:%d/metrics", self.port)

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler(render: Callable[[], str]) -> type[http.server.BaseHTTPRequestHandler]:
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404, "metrics are at /metrics")
                return
            try:
                body = render().encode()
            except Exception:  # the figures could not be read: say so, keep serving
                logger.exception("rendering the metrics failed")
                self.send_error(500, "the service's figures could not be read")
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("metrics request: %s", format % args)

    return Handler
