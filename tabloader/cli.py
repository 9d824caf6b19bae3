"""The ``tabloader`` command line: a thin layer over the public API.

Data goes to stdout; logs, progress bars and errors go to stderr. A ``TabloaderError`` prints
one line ``ErrorName: message`` and exits 1 (the traceback only with ``--debug``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tabloader._format import format_table

if TYPE_CHECKING:
    from tabloader.service._server import ClientInfo

__all__ = ["COMMANDS", "format_table", "main"]

logger = logging.getLogger(__name__)


def _open_catalog(args: argparse.Namespace, *, create: bool = False) -> Any:
    """The catalog of ``--catalog``: only imports (``create``) make one where there is none."""
    from tabloader import catalog

    return catalog.open_catalog(args.catalog, create=create)


def _connect(args: argparse.Namespace, *, create: bool = False) -> Any:
    """``tabloader.connect`` of ``--catalog``: through its service while one runs."""
    from tabloader.service._connection import connect

    return connect(args.catalog, create=create)


def _print(text: Any, **kwargs: Any) -> None:
    """``print`` for every line the CLI writes: control characters of names and values (a
    terminal escape in a dataset name, a SELECTed string) are shown, not sent to the terminal.
    """
    from tabloader._format import printable

    print(printable(text), **kwargs)


def print_result(result: Any) -> None:
    """Print a statement's result (see ``tabloader._format.describe_result``)."""
    from tabloader._format import describe_result

    _print(describe_result(result))


# -- sql ---------------------------------------------------------------------------------------
SQL_GRAMMAR = """\
statements (one per call; keywords in any case):
  CREATE DATASET name FROM 'path' [FORMAT imagefolder|parquet|arrow|hf]
  APPEND TO DATASET name FROM 'path' [FORMAT ...]
  REGISTER [OR REPLACE] JOB name SELECT col, ... | * FROM dataset
      [WHERE predicate] [WITH (option = value, ...)]
  UNREGISTER JOB [IF EXISTS] name
  SHOW DATASETS | SHOW JOBS | DESCRIBE name
  DROP DATASET [IF EXISTS] name [CASCADE]
  SELECT ...                     read-only, on the dataset tables

predicates: comparisons, AND/OR/NOT, IN (...), BETWEEN, LIKE, IS NULL, arithmetic, casts and
  an allow-list of functions (an error names them); no subqueries or table functions.
"""


def _sql_epilog() -> str:
    from tabloader.catalog._options import JOB_OPTIONS

    lines = ["job options (WITH):"]
    for o in JOB_OPTIONS.values():
        kind = "|".join(o.choices) if o.choices else o.type.__name__
        rng = f" {o.minimum}..{o.maximum}" if o.minimum is not None else ""
        default = "" if o.default is None else f", default {o.default}"
        lines.append(f"  {o.name:<11} {kind}{rng}: {o.help}{default}")
    return (
        "\n".join(lines)
        + """

examples:
  tabloader sql "REGISTER JOB cnn SELECT image, label FROM photos WHERE label < 6"
  echo "SHOW JOBS; SHOW DATASETS" | tabloader sql -"""
    )


def _register_sql(sub: Any) -> None:
    p = sub.add_parser(
        "sql",
        help="run one statement ('-' reads statements from stdin)",
        description=SQL_GRAMMAR,
        epilog=_sql_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("statement", help="the statement, or '-' for statements from stdin")


def _service(args: argparse.Namespace) -> Any:
    """The running service of the catalog (statements go through it), or None.

    Raises:
        ServiceStuckError: a service runs but does not answer (stopped or hung).
    """
    from tabloader.catalog._directory import DB_FILE
    from tabloader.catalog._errors import ServiceError, ServiceStuckError
    from tabloader.service._client import RemoteLoader

    root = _root(args)
    if not (root / DB_FILE).exists():  # no catalog, so no service: nothing is created here
        return None
    try:
        return RemoteLoader(root, start=False)
    except ServiceStuckError:  # it runs (and holds the catalog) but does not answer: say so
        raise
    except ServiceError:
        return None


def _root(args: argparse.Namespace) -> Path:
    from tabloader.catalog._directory import resolve_root

    return resolve_root(args.catalog)


def _run_sql(args: argparse.Namespace) -> int:
    from tabloader.catalog._sql.dialect import split_statements

    text = sys.stdin.read() if args.statement == "-" else args.statement
    statements = split_statements(text) if args.statement == "-" else [text]
    with _connect(args) as cat:  # through the service while one runs
        for statement in statements:
            print_result(cat.sql(statement))
    return 0


# -- import ------------------------------------------------------------------------------------
def _register_import(sub: Any) -> None:
    p = sub.add_parser("import", help="import a dataset from a path")
    p.add_argument("name", help="the dataset name")
    p.add_argument("path", help="image folder, Parquet/Arrow file or glob, or HF save_to_disk dir")
    p.add_argument(
        "--format",
        choices=["imagefolder", "parquet", "arrow", "hf"],
        help="source format (default: guessed from the path)",
    )
    p.add_argument("--split", help="for a HuggingFace DatasetDict: the split to import")
    p.add_argument("--append", action="store_true", help="append rows to an existing dataset")
    p.add_argument(
        "--storage",
        metavar="URI",
        help="store the dataset's parts there (s3://bucket/prefix) instead of in the catalog "
        "directory; endpoint and credentials from the AWS environment (docs/object-storage.md)",
    )
    p.add_argument(
        "--follow-links",
        action="store_true",
        help="read what symbolic links in the folder lead to outside it (refused by default)",
    )


def _run_import(args: argparse.Namespace) -> int:
    from tabloader.catalog._importers import detect_format

    fmt = args.format or detect_format(args.path)
    with _connect(args, create=True) as cat:  # through the service while one runs
        ds = cat.import_path(
            args.name,
            args.path,
            format=fmt,
            append=args.append,
            follow_links=args.follow_links,
            split=args.split if fmt == "hf" else None,
            storage=args.storage,
        )
        print_result(ds)
    return 0


# -- verify ------------------------------------------------------------------------------------
def _register_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="read every stored row and check its checksums; exit 1 if anything is damaged",
    )
    p.add_argument("dataset", nargs="?", help="the dataset to check (default: all)")


def _run_verify(args: argparse.Namespace) -> int:
    with _connect(args) as cat:  # a service holding the catalog: an error naming the fix
        report = cat.verify(args.dataset)
    _print(report)
    return 0 if report.ok else 1


# -- status ------------------------------------------------------------------------------------
def _register_status(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="who serves the catalog (its loader service, a Ray cluster, or nothing): open "
        "jobs, reads, decodes, cache, stalls",
    )
    p.add_argument("--json", action="store_true", help="the counters as one JSON object")
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="the service's figures in Prometheus' text format (per job, per rank, per "
        "dataset; see docs/metrics.md)",
    )
    _ray_argument(
        p,
        "the catalog's loaders on the Ray cluster at ADDRESS (default: auto); without it, the "
        "cluster recorded under the catalog by tabloader serve --ray",
    )


def _ray_argument(p: Any, text: str) -> None:
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS", help=text)


def _run_status(args: argparse.Namespace) -> int:
    import json

    from tabloader.catalog._directory import DB_FILE, not_a_catalog

    root = _root(args)
    if not (root / DB_FILE).exists():
        raise not_a_catalog(root)
    remote = _service(args)
    stats, pid = None, None
    if remote is not None:
        try:
            stats, pid = remote.stats(), remote.service_pid
        finally:
            remote.close()
    if args.prometheus:
        from tabloader.service._metrics import render_metrics

        _print(render_metrics(stats), end="")
        return 0
    report = {**status_report(root, pid, stats), "ray": _ray_report(root, args.ray)}
    if args.json:
        _print(json.dumps(report))
        return 0
    if stats is not None:
        _print_service(report)
    if report["ray"] is not None:
        _print_cluster(root, report["ray"])
    if stats is None and report["ray"] is None:
        _print(
            f"No loader service runs for catalog {root}, and no Ray cluster serves it: the "
            "first JobDataset starts a service, or run tabloader serve (--ray: on a cluster)."
        )
    return 0


def _ray_report(root: Path, address: str | None) -> dict[str, Any] | None:
    """The Ray cluster that serves the catalog: at ``address`` (``--ray``; an error if no
    leader serves it there), else the one recorded under the catalog, if any (``address``,
    the serving ``pid``, and the leader's status, or its ``error``)."""
    from tabloader.cluster._actor import cluster_status
    from tabloader.cluster._record import recorded_leader

    if address is not None:
        return {"address": address, "pid": None, **cluster_status(root, address)}
    record = recorded_leader(root)
    if record is None:
        return None
    try:
        return {**record, **cluster_status(root, record["address"])}
    except Exception as exc:  # a cluster that went away under its recording process
        return {**record, "error": str(exc).strip().splitlines()[0]}


def _print_service(report: dict[str, Any]) -> None:
    cache, clients = report["cache"], report["clients"]
    _print(f"Loader service pid {report['service_pid']} for catalog {report['catalog']}")
    _print(
        f"clients: {len(clients)}" + (f" ({'; '.join(map(_client, clients))})" if clients else "")
    )
    _print(
        f"reads {report['reads']:,}, decodes {report['decodes']:,}, "
        f"bytes read {report['bytes_read']:,}"
    )
    rate = "-" if cache["hit_rate"] is None else f"{cache['hit_rate']:.1%}"
    _print(
        f"cache: {cache['size_bytes']:,} of {cache['capacity_bytes']:,} bytes "
        f"({cache['fill']:.1%} full), {cache['entries']:,} values, {cache['pinned']:,} pinned; "
        f"hit rate {rate} ({cache['hits']:,} hits, {cache['misses']:,} misses), "
        f"{cache['evictions']:,} evictions"
    )
    if "storage" in report:
        _print(storage_line(report["storage"]))
    keys = ["job", "dataset", "ranks", "epoch", "batches", "rows", "rows_per_s", "shared"]
    keys += ["wait_s", "augment_s", "compute_s", "regime"]
    jobs = [{**j, "ranks": j["world_size"]} for j in report["jobs"]]  # counts: over the ranks
    _print(
        format_table([{k: j.get(k) for k in keys} for j in jobs], keys) if jobs else "no open jobs"
    )


def storage_line(storage: dict[str, Any]) -> str:
    """Where the bytes read came from: the bucket (object storage), the local storage tier,
    peer nodes (a Ray cluster's partitioned cache), local files."""
    tier, peers = storage.get("tier"), storage.get("peers")
    parts = [
        f"bucket {storage.get('bucket_bytes', 0):,} bytes in "
        f"{storage.get('bucket_requests', 0):,} requests",
        "tier off"
        if tier is None
        else f"tier {tier['hit_bytes']:,} bytes ({tier['used_bytes']:,} of "
        f"{tier['capacity_bytes']:,} bytes held)",
    ]
    if peers is not None:
        parts.append(f"peers {peers['peer_bytes']:,} bytes")
    parts.append(f"local files {storage.get('local_bytes', 0):,} bytes")
    return "storage: " + "; ".join(parts)


def _storage_columns(storage: dict[str, Any] | None) -> dict[str, Any]:
    """A node's bytes from the bucket, its own tier and its peers (``-``: none reported)."""
    storage = storage or {}
    tier, peers = storage.get("tier") or {}, storage.get("peers") or {}
    return {
        "bucket_bytes": storage.get("bucket_bytes", "-"),
        "tier_bytes": tier.get("hit_bytes", "-"),
        "peer_bytes": peers.get("peer_bytes", "-"),
    }


def _client(client: ClientInfo) -> str:
    """``pid 12: cnn, vit[1/2]`` (a rank of a data-parallel job), or ``pid 12: no job``."""
    jobs = [
        j["job"] + (f"[{j['rank']}/{j['world_size']}]" if j["world_size"] > 1 else "")
        for j in client["jobs"]
    ]
    return f"pid {client['pid']}: {', '.join(jobs) or 'no job'}"


def status_report(root: Path, pid: int | None, stats: dict[str, Any] | None) -> dict[str, Any]:
    """What ``tabloader status --json`` prints: the service's counters, ``clients`` and
    ``jobs`` as lists, and the cache's ``hit_rate`` (None before any look-up) and ``fill``
    (the share of its bytes in use). With no service: ``service_pid`` None, no clients or
    jobs."""
    if stats is None:
        return {"catalog": str(root), "service_pid": None, "clients": [], "jobs": []}
    cache = stats["cache"]
    looked_up = cache["hits"] + cache["misses"]
    return {
        "catalog": str(root),
        "service_pid": pid,
        **stats,
        "cache": {
            **cache,
            "hit_rate": cache["hits"] / looked_up if looked_up else None,
            "fill": cache["size_bytes"] / cache["capacity_bytes"],
        },
        "jobs": list(stats["jobs"].values()),
    }


def _print_cluster(root: Path, status: dict[str, Any]) -> None:
    by = f" (served by pid {status['pid']})" if status["pid"] is not None else ""
    if "error" in status:
        _print(
            f"A Ray cluster at {status['address']}{by} is recorded as serving catalog {root}, "
            f"but does not answer: {status['error']}"
        )
        return
    nodes = status["nodes"]
    _print(
        f"Ray cluster at {status['address']}{by} serves catalog {root}: {len(nodes)} node(s), "
        f"leader generation {status['generation']}; reads {status['reads']:,}, decodes "
        f"{status['decodes']:,}"
    )
    storage = status.get("storage")
    if storage is not None:
        _print(
            f"storage: bucket {storage['bucket_bytes']:,} bytes, tiers {storage['tier_bytes']:,}"
            f" bytes, peers {storage['peer_bytes']:,} bytes"
        )
    rows = [
        {
            "node": n[:16],
            "reads": s["reads"],
            "decodes": s["decodes"],
            "hits": s["cache"]["hits"],
            **_storage_columns(s.get("storage")),
            "clients": s["clients"],
            "ranks": ", ".join(sorted(s["jobs"])) or "-",
        }
        for n, s in sorted(nodes.items())
    ]
    if rows:
        _print(format_table(rows, list(rows[0])))
    jobs = [
        {"job": j["job"], "epoch": j["epoch"], "ranks": len(j["ranks"]), "left": len(j["left"])}
        for j in status["jobs"]
    ]
    _print(format_table(jobs, ["job", "epoch", "ranks", "left"]) if jobs else "no cluster jobs")
    for name, why in status["gone"].items():
        _print(f"job {name} left the cluster: {why}")


# -- analyze -----------------------------------------------------------------------------------
def _register_analyze(sub: Any) -> None:
    from tabloader.analyze import DEFAULT_BATCHES, DEFAULT_SECONDS

    p = sub.add_parser(
        "analyze",
        help="profile a job by differential runs and predict other configurations (what-if)",
        description="Measure where a registered job's time goes (ingestion, preparation, cache "
        "and storage fetch, sharing with the other jobs) with a loader service of its own, "
        "then predict seconds per epoch and stall fraction (see docs/analyze.md). No loader "
        "service may run for the catalog meanwhile.",
    )
    p.add_argument("job", help="the registered job")
    p.add_argument("--step", type=float, default=0.0, help="the loop's seconds a batch (0)")
    p.add_argument(
        "--batches",
        type=int,
        default=DEFAULT_BATCHES,
        help=f"the fewest batches the first run reads (default {DEFAULT_BATCHES})",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=DEFAULT_SECONDS,
        help=f"the shortest the first run reads (default {DEFAULT_SECONDS:g}; more is more "
        "precise, as CPU is counted in 10 ms ticks)",
    )
    p.add_argument("--workers", default=None, help="decode processes of the analysis (cores)")
    p.add_argument("--cache-bytes", default=None, help="cache of the analysis (1 GiB)")
    p.add_argument(
        "--what-if",
        action="append",
        default=[],
        metavar="KEY=VALUE,...",
        help="a configuration to predict (repeatable): workers=N, cache_bytes=B, jobs=J, "
        "storage_mbps=M, cores=C, step=S, any subset",
    )
    p.add_argument("--epochs", type=int, default=1, help="epochs of a fresh process (1)")
    p.add_argument("--json", action="store_true", help='{"measured": ..., "predictions": ...}')
    p.add_argument("--plot", metavar="FILE.png", help="draw stall fraction (matplotlib)")


def _run_analyze(args: argparse.Namespace) -> int:
    import json

    from tabloader.analyze import analyze, parse_what_if, plot_analysis

    what_ifs = [parse_what_if(text) for text in args.what_if]  # a typo fails before the runs
    analysis = analyze(
        _root(args),
        args.job,
        what_ifs=what_ifs,
        epochs=args.epochs,
        step=args.step,
        batches=args.batches,
        seconds=args.seconds,
        workers=None if args.workers is None else _flag("workers", args.workers),
        cache_bytes=None if args.cache_bytes is None else _flag("cache_bytes", args.cache_bytes),
    )
    if args.plot:
        plot_analysis(analysis, args.plot)
    _print(json.dumps(analysis.to_json()) if args.json else analysis.format())
    return 0


# -- serve -------------------------------------------------------------------------------------
def _register_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the catalog's loader service (in the foreground)")
    p.add_argument(
        "--cache-bytes",
        default=None,
        help="shared-memory cache size: bytes or e.g. 2GiB (default: $TABLOADER_CACHE_BYTES "
        "or 1 GiB)",
    )
    p.add_argument(
        "--storage-cache-bytes",
        default=None,
        help="the local storage tier of datasets in object storage, on disk under the "
        "catalog's cache/ folder: bytes or e.g. 100GiB; 0 turns it off (default: "
        "$TABLOADER_STORAGE_CACHE_BYTES or 0)",
    )
    p.add_argument("--workers", default=None, help="decode processes (default: cores)")
    p.add_argument("--idle-exit", default=None, help="stop this many seconds after the last client")
    p.add_argument(
        "--max-image-megapixels",
        default=None,
        help="refuse images whose header declares more megapixels, before decoding them "
        "(default: $TABLOADER_MAX_IMAGE_MEGAPIXELS or 64)",
    )
    _ray_argument(
        p,
        "serve the Ray cluster at ADDRESS (default: auto): a leader and a loader on every "
        "node, also on nodes that join later",
    )
    p.add_argument(
        "--metrics-port",
        default=None,
        metavar="PORT",
        help="serve the figures of tabloader status --prometheus at "
        "http://127.0.0.1:PORT/metrics for Prometheus to scrape (loopback only; 0: any free "
        "port, logged)",
    )
    p.add_argument(
        "--access-log",
        default=None,
        help="record every look-up and release of prepared values to this .npz file when the "
        "service stops (to replay the cache's requests offline: docs/benchmarks.md)",
    )


def _run_serve(args: argparse.Namespace) -> int:
    import os

    from tabloader.service._server import Service, keep_temp_private, log_to_file, yield_to_jobs

    cache = _flag("cache_bytes", args.cache_bytes)
    tier = _flag("storage_cache_bytes", args.storage_cache_bytes)
    workers = _flag("workers", args.workers)
    idle_exit = None if args.idle_exit is None else _flag("idle_exit", args.idle_exit)
    megapixels = _flag("max_image_megapixels", args.max_image_megapixels)
    metrics_port = None if args.metrics_port is None else _flag("metrics_port", args.metrics_port)
    if args.ray is not None and args.max_image_megapixels is not None:
        from tabloader.catalog._errors import CatalogError

        raise CatalogError(
            "--max-image-megapixels sets a local service's limit; for a Ray cluster set "
            "$TABLOADER_MAX_IMAGE_MEGAPIXELS in every node's environment instead."
        )
    if args.ray is not None and metrics_port is not None:
        from tabloader.catalog._errors import CatalogError

        raise CatalogError(
            "--metrics-port serves a local service's figures; on a Ray cluster, use Ray's own "
            "metrics, or tabloader status --ray."
        )
    yield_to_jobs()  # before any thread or process starts: they inherit it
    if args.ray is None:  # the decode processes' forkserver, forked before any thread starts
        from tabloader.engine._prepare import zygote

        zygote.fork()
    else:
        from tabloader.cluster._actor import serve_cluster

        root = _root(args).resolve()

        def ready(nodes: int) -> None:
            _print(
                f"tabloader: serving catalog {root} on {nodes} Ray node(s) (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )

        serve_cluster(
            root,
            args.ray,
            ready=ready,
            cache_bytes=cache,
            workers=workers,
            storage_cache_bytes=tier,
        )
        return 0
    service = Service(
        _root(args),
        cache_bytes=cache,
        workers=workers,
        idle_exit=idle_exit,
        access_log=args.access_log,
        max_image_megapixels=megapixels,
        storage_cache_bytes=tier,
        metrics_port=metrics_port,
    )
    keep_temp_private(service.root)  # the service's lock is ours; no decode process yet
    log = log_to_file(service.root)
    _print(
        f"tabloader: serving catalog {service.root} (pid {os.getpid()}); log: {log}",
        file=sys.stderr,
    )
    if service.metrics is not None:
        _print(
            f"tabloader: metrics at http://127.0.0.1:{service.metrics.port}/metrics",
            file=sys.stderr,
        )
    service.serve()
    return 0


def _flag(name: str, value: str | None) -> Any:
    """Setting ``name`` from its flag (``value``), else its environment variable, else its
    default, checked by ``tabloader.catalog._settings``."""
    from tabloader.catalog._settings import SETTINGS

    setting = SETTINGS[name]
    return setting.check(value, setting.flag) if value is not None else setting.resolve()


# -- demo --------------------------------------------------------------------------------------
def _register_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="generate an image dataset, import it and register jobs")
    p.add_argument("--images", type=int, default=3000, help="images to generate (default 3000)")
    p.add_argument("--data", default="demo-data", help="where to generate the image folder")


def _run_demo(args: argparse.Namespace) -> int:
    from tabloader._demo import run_demo

    with _open_catalog(args, create=True) as cat:
        run_demo(cat, data_dir=args.data, num_images=args.images)
    return 0


COMMANDS: dict[str, tuple[Callable[[Any], None], Callable[[argparse.Namespace], int]]] = {
    "analyze": (_register_analyze, _run_analyze),
    "demo": (_register_demo, _run_demo),
    "import": (_register_import, _run_import),
    "serve": (_register_serve, _run_serve),
    "sql": (_register_sql, _run_sql),
    "verify": (_register_verify, _run_verify),
    "status": (_register_status, _run_status),
}


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``tabloader``: every command, or only ``commands`` (a started
    service parses ``serve`` alone: the others' help imports modules it never uses, such as
    ``tabloader.analyze``, on the path to its first batch)."""
    from tabloader import __version__

    parser = argparse.ArgumentParser(
        prog="tabloader",
        description="Dataset tables that several training jobs load from together.",
    )
    parser.add_argument("--version", action="version", version=f"tabloader {__version__}")
    _add_global_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (register, _) in COMMANDS.items():
        if commands is None or name in commands:
            register(sub)
    # The global options are accepted after the subcommand too (tabloader sql --catalog DIR):
    # there they default to SUPPRESS, so an option given before the subcommand is kept.
    for command in sub.choices.values():
        _add_global_options(command, argparse.SUPPRESS)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, default: Any) -> None:
    def given(value: Any) -> Any:
        return default if default is not None else value

    parser.add_argument(
        "--catalog",
        metavar="DIR",
        default=given(None),
        help="catalog directory (default: $TABLOADER_CATALOG, else "
        "~/.local/share/tabloader/catalog)",
    )
    parser.add_argument(
        "--debug", action="store_true", default=given(False), help="show tracebacks"
    )
    parser.add_argument("-v", "--verbose", action="count", default=given(0), help="more logging")
    parser.add_argument(
        "-q", "--quiet", action="store_true", default=given(False), help="errors only"
    )


STDOUT_CLOSED = 141
"""The exit code when the reader of stdout went away (``tabloader status | head -1``): a
shell's code for a process that SIGPIPE ended, as ``cat`` or ``ls`` end there."""


def main(argv: Sequence[str] | None = None, *, commands: Collection[str] | None = None) -> int:
    """Run the CLI (``commands``: only those, see ``build_parser``); return the exit code.

    A reader of stdout that closed its end early (``| head -1``) ends the command quietly with
    ``STDOUT_CLOSED``, not a ``BrokenPipeError`` traceback: Python ignores SIGPIPE, so the
    write that finds the pipe closed raises, wherever the command was.
    """
    try:
        return _main(argv, commands)
    except BrokenPipeError:
        if not _stdout_closed():  # a socket's: a real error
            raise
        _stdout_to_devnull()
        return STDOUT_CLOSED


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (its write end polls as an error)."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without one
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at the null device: what is still buffered is flushed
    there at exit, or Python reports the same ``BrokenPipeError`` again then."""
    import os

    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())
    finally:
        os.close(null)


def _main(argv: Sequence[str] | None, commands: Collection[str] | None) -> int:
    from tabloader.catalog._errors import TabloaderError

    parser = build_parser(commands)
    args = parser.parse_args(argv)
    level = (
        logging.ERROR
        if args.quiet
        else (
            logging.INFO
            if args.verbose == 1
            else logging.DEBUG
            if args.verbose > 1
            else logging.WARNING
        )
    )
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.quiet:
        from tabloader.catalog._progress import disable_progress_bars

        disable_progress_bars()
    try:
        code = COMMANDS[args.command][1](args)
        sys.stdout.flush()  # here, where a closed pipe is handled, not at exit
        return code
    except TabloaderError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())
        _print(f"{type(exc).__name__}: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _print("Interrupted.", file=sys.stderr)
        return 130
