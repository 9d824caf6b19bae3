"""Cluster benchmark: jobs with ranks on a simulated Ray cluster, node loaders vs DataLoaders.

A ``ray.cluster_utils.Cluster`` of ``--nodes`` simulated nodes on the loopback address (one
CPU and one custom resource each, to place ranks) runs ``--jobs`` jobs on overlapping subsets
of the ``bench e2e`` images, each with ``--nodes`` ranks, rank ``r`` on node ``r``. Every rank
reads one epoch in a Ray task, sleeping ``--step`` seconds per batch. Side by side:

* ``tabloader``: the leader and a loader per node (``tabloader serve --ray``); each rank is a
  ``JobDataset`` that finds its node's loader;
* ``dataloader``: each rank reads its equal share of its job's rows (a random permutation cut
  like ``DistributedSampler(drop_last=True)``) with its own ``torch.utils.data.DataLoader``
  (one worker; same files, same decode and resize as tabloader).

``--address HOST:PORT`` runs it on a running Ray cluster instead, whose nodes carry the
custom resources ``node0`` .. ``node{N-1}`` (one each; ``--nodes N``) that place the ranks.

Every rank gets ready first (imports, its connection or DataLoader worker), then all start at
one instant (a barrier actor); wall time runs from there to the last rank's end.

Reported: per node, decodes / the union of the rows its ranks read (target <= 1.05); total
decodes vs the baseline's; wall time ratio; the leader's sampling cost per round with
``--cost-jobs`` jobs x ``--cost-ranks`` ranks over ``--cost-nodes`` nodes (in-process, no
Ray); and a line of stall accounting per competitor: the ranks' seconds waiting for data vs
computing (as the node loaders counted them; a DataLoader rank times its ``next()``), and the
node loaders' seconds reading, decoding and collating.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from benchmarks import format_table, positive_int, write_json
from benchmarks.e2e_children import MapDataset
from benchmarks.imagedata import prepare
from benchmarks.stalls import StallClock, dataset_seconds, stall_row, stalls_of

__all__ = ["add_arguments", "run"]

TARGET = 1.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks cluster``."""
    parser.add_argument("--images", type=positive_int, default=800, help="generated JPEGs")
    parser.add_argument("--image-size", type=positive_int, default=96)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument(
        "--nodes", type=positive_int, default=2, help="simulated nodes (ranks per job)"
    )
    parser.add_argument(
        "--address",
        help="a running Ray cluster (HOST:PORT) whose nodes carry the resources node0 .. "
        "node{N-1}, instead of a simulated one",
    )
    parser.add_argument("--jobs", type=positive_int, default=4)
    parser.add_argument("--step", type=float, default=0.02, help="seconds per batch")
    parser.add_argument("--cost-jobs", type=positive_int, default=8)
    parser.add_argument("--cost-ranks", type=positive_int, default=4)
    parser.add_argument("--cost-nodes", type=positive_int, default=4)
    parser.add_argument("--data", default="bench-results/e2e-data", help="image folder cache")
    parser.add_argument("--out", default="bench-results/cluster.json", help="JSON output")


def _where(j: int, jobs: int) -> str:
    """Job ``j``'s subset: 7 of 10 classes, shifted per job (neighbours overlap)."""
    classes = [(j * 10 // jobs + k) % 10 for k in range(7)]
    return f"label IN ({', '.join(map(str, classes))})"


class _Barrier:
    """Every rank of a run gets ready (imports, connection, workers), then all start at once:
    wall time runs from that instant (a cold ``import torch`` in a fresh Ray worker took 5 s
    of a 9 s run)."""

    def __init__(self, n: int) -> None:
        import asyncio

        self.n, self.count, self.go = n, 0, asyncio.Event()

    async def wait(self) -> float:
        self.count += 1
        if self.count >= self.n:
            self.go.set()
        await self.go.wait()
        return time.time()


def _rank_tabloader(
    root: str, job: str, rank: int, world: int, step: float, barrier: Any
) -> dict[str, Any]:
    import ray

    from tabloader.torch import JobDataset

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    ds = JobDataset(job, catalog=root, epochs=1)
    _ = ds.epoch  # connected and joined, as a DataLoader's workers are started below
    start = ray.get(barrier.wait.remote())
    ids: list[int] = []
    for batch in ds:
        ids += batch["_id"].tolist()
        time.sleep(step)
    end = time.time()
    stalls = stalls_of(ds.stats())  # this rank's, as its node's loader counted them
    loader = ds.loader.stats()  # the node loader's counters, as this rank ends
    ds.close()
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "job": job,
        "ids": ids,
        "start": start,
        "end": end,
        **stalls,
        "dataset_s": dataset_seconds(loader),
    }


def _rank_dataloader(
    root: str, job: str, ids: list[int], size: int, batch_size: int, step: float, barrier: Any
) -> dict[str, Any]:
    import ray
    import torch

    dataset: Any = MapDataset(root, "imgs", ids, size)
    loader: Any = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=1,
        drop_last=False,
    )
    batches = iter(loader)  # its worker starts
    start = ray.get(barrier.wait.remote())
    read: list[int] = []
    clock = StallClock()  # no engine counts a DataLoader's stalls: the rank times them
    for _, _, rows in clock.timed(batches):
        read += rows.tolist()
        time.sleep(step)
    return {
        "node": ray.get_runtime_context().get_node_id(),
        "job": job,
        "ids": read,
        "start": start,
        "end": time.time(),
        **clock.stats(),
    }


def _leader_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per leader step with ``cost_jobs`` jobs x ``cost_ranks`` ranks."""
    from pyroaring import BitMap

    from tabloader.catalog import Job
    from tabloader.cluster import Leader, state_json

    leader = Leader(seed=0, lookahead=1 << 30, round_rows=256)
    nodes = [f"n{i}" for i in range(args.cost_nodes)]
    n = 100_000
    for j in range(args.cost_jobs):
        lo = j * n // (2 * args.cost_jobs)
        ranks = [nodes[(j + r) % len(nodes)] for r in range(args.cost_ranks)]
        ids = BitMap(range(lo, lo + n // 2))
        job = Job(f"j{j}", "bench", 1, ("image",), None, {"batch_size": 32}, ids)
        leader.add_job(job, nodes=ranks)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        leader.step()
        times.append(time.perf_counter() - t0)
    rows = args.cost_jobs * 256
    saves = []
    for _ in range(20):  # what the leader actor writes after each acknowledgement
        t0 = time.perf_counter()
        state_json(leader)
        saves.append(time.perf_counter() - t0)
    return {
        "checkpoint_ms_p50": round(statistics.median(saves) * 1e3, 3),
        "jobs": args.cost_jobs,
        "ranks": args.cost_ranks,
        "nodes": args.cost_nodes,
        "ms_per_round_p50": round(statistics.median(times) * 1e3, 3),
        "us_per_row": round(statistics.median(times) * 1e6 / rows, 3),
    }


def run(args: argparse.Namespace) -> int:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # servers on loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from tabloader import catalog
    from tabloader.cluster import Cluster

    root_path, _, _ = prepare(args)
    root = str(root_path)
    jobs = [f"cluster_{j}" for j in range(args.jobs)]
    with catalog.open_catalog(root) as cat:
        for j, name in enumerate(jobs):
            cat.register_job(
                name,
                "imgs",
                columns=["image", "label"],
                where=_where(j, args.jobs),
                options={"image_size": args.image_size, "batch_size": args.batch_size},
                replace=True,
            )
        sets = {name: sorted(cat.job(name).ids) for name in jobs}
    sim = None
    if args.address is None:
        head = {"num_cpus": 1, "resources": {"node0": 1}, "node_ip_address": "127.0.0.1"}
        sim = RayCluster(initialize_head=True, head_node_args={**head, "include_dashboard": False})
        for i in range(1, args.nodes):
            sim.add_node(num_cpus=1, resources={f"node{i}": 1}, node_ip_address="127.0.0.1")
        sim.wait_for_nodes()
    results: dict[str, Any] = {}
    try:
        address = args.address if sim is None else sim.address
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        _check_nodes(args.nodes)
        on = [{"resources": {f"node{i}": 0.01}, "num_cpus": 0} for i in range(args.nodes)]
        ranks = len(jobs) * args.nodes
        barrier_cls: Any = ray.remote(num_cpus=0)(_Barrier)
        # tabloader: a loader per node, ranks through JobDataset
        cache = 64 * args.image_size * args.image_size * 3 * 64
        cluster = Cluster(root, workers=1, cache_bytes=max(cache, 32 << 20))
        try:
            cluster.wait_ready()
            task: Any = ray.remote(_rank_tabloader)
            barrier = barrier_cls.remote(ranks)
            refs = [
                task.options(**on[r]).remote(root, job, r, args.nodes, args.step, barrier)
                for job in jobs
                for r in range(args.nodes)
            ]
            ranks_tl = ray.get(refs, timeout=3600)
            got, wall = _ended(ranks_tl)
            per_node = {
                n: ray.get(a.stats.remote(), timeout=60)["decodes"]
                for n, a in cluster.loaders.items()
            }
        finally:
            cluster.close()
        results["tabloader"] = {
            "wall_s": wall,
            "got": got,
            "decodes": per_node,
            "stalls": _stalls(ranks_tl),
        }
        # the baseline: a DataLoader per rank
        task = ray.remote(_rank_dataloader)
        rng = np.random.default_rng(0)
        barrier = barrier_cls.remote(ranks)
        refs = []
        for job in jobs:
            order = rng.permutation(sets[job])
            share = len(order) // (args.batch_size * args.nodes) * args.batch_size
            for r in range(args.nodes):
                part = order[r * share : (r + 1) * share].tolist()
                refs.append(
                    task.options(**on[r]).remote(
                        root, job, part, args.image_size, args.batch_size, args.step, barrier
                    )
                )
        ranks_dl = ray.get(refs, timeout=3600)
        got_dl, wall_dl = _ended(ranks_dl)
        results["dataloader"] = {"wall_s": wall_dl, "got": got_dl, "stalls": _stalls(ranks_dl)}
    finally:
        ray.shutdown()
        if sim is not None:
            sim.shutdown()
    return _report(args, jobs, results)


def _check_nodes(nodes: int) -> None:
    """Every resource ``node0`` .. ``node{nodes-1}`` that places a rank is on the cluster."""
    import ray

    have = ray.cluster_resources()
    missing = [f"node{i}" for i in range(nodes) if have.get(f"node{i}", 0) < 1]
    if missing:
        raise SystemExit(
            f"The Ray cluster has no node with the resource(s) {', '.join(missing)}, which "
            f"place the ranks of --nodes {nodes}: start each node with "
            "--resources='{\"nodeI\": 1}' (I = 0, 1, ...), or lower --nodes."
        )


def _ended(out: list[dict[str, Any]]) -> tuple[list[tuple[str, list[int]]], float]:
    """(node, ids) per rank, and the wall time from the common start to the last end."""
    start = max(o["start"] for o in out)
    return [(o["node"], o["ids"]) for o in out], max(o["end"] for o in out) - start


def _stalls(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A competitor's stall accounting: per job (its ranks summed) ``wait_s`` and
    ``compute_s``, each rank's, and the node loaders' ``read_s``, ``decode_s``, ``collate_s``
    summed over the nodes (each node's from the last of its ranks to end; None for
    DataLoaders)."""
    jobs: dict[str, dict[str, float]] = {}
    for r in ranks:
        job = jobs.setdefault(r["job"], {"wait_s": 0.0, "compute_s": 0.0})
        job["wait_s"] += r["wait_s"]
        job["compute_s"] += r["compute_s"]
    dataset_s = None
    if all("dataset_s" in r for r in ranks):
        last = {r["node"]: r for r in sorted(ranks, key=lambda r: r["end"])}
        dataset_s = {
            k: round(sum(r["dataset_s"][k] for r in last.values()), 4)
            for k in ("read_s", "decode_s", "collate_s")
        }
    return {
        "jobs": jobs,
        "ranks": [{k: r[k] for k in ("job", "node", "wait_s", "compute_s")} for r in ranks],
        "dataset_s": dataset_s,
    }


def _report(args: argparse.Namespace, jobs: list[str], results: dict[str, Any]) -> int:
    tl, dl = results["tabloader"], results["dataloader"]
    nodes = sorted({node for node, _ in tl["got"]})
    rows_out = []
    ok = True
    for i, node in enumerate(nodes):
        needed = set().union(*(set(ids) for n, ids in tl["got"] if n == node))
        ratio = tl["decodes"].get(node, 0) / max(1, len(needed))
        ok &= ratio <= TARGET
        rows_out.append(
            {
                "node": f"node{i} ({node[:8]})",
                "decodes": tl["decodes"].get(node, 0),
                "union_needed": len(needed),
                "ratio": round(ratio, 4),
                "target": f"<= {TARGET}",
                "ok": ratio <= TARGET,
            }
        )
    print(format_table(rows_out, list(rows_out[0])))
    total = sum(tl["decodes"].values())
    baseline = sum(len(ids) for _, ids in dl["got"])  # a DataLoader decodes every row it reads
    cost = _leader_cost(args)
    summary = [
        {"check": "total decodes, tabloader", "value": total},
        {"check": "total decodes, DataLoader per rank", "value": baseline},
        {"check": "decodes tabloader / DataLoaders", "value": round(total / baseline, 4)},
        {"check": "wall tabloader (s)", "value": round(tl["wall_s"], 3)},
        {"check": "wall DataLoaders (s)", "value": round(dl["wall_s"], 3)},
        {"check": "wall tabloader / DataLoaders", "value": round(tl["wall_s"] / dl["wall_s"], 4)},
        {
            "check": f"leader step, {cost['jobs']} jobs x {cost['ranks']} ranks, p50 ms",
            "value": cost["ms_per_round_p50"],
        },
        {"check": "leader cost per sampled row (us)", "value": cost["us_per_row"]},
        {"check": "leader checkpoint per ack, p50 ms", "value": cost["checkpoint_ms_p50"]},
    ]
    print(format_table(summary, ["check", "value"]))
    stalls = [
        {"competitor": name, **stall_row(results[name]["stalls"])}
        for name in ("tabloader", "dataloader")
    ]
    print()
    print(
        "stalls: ranks' seconds waiting for data vs computing (summed; per job wait/compute), "
        "and the node loaders' seconds reading, decoding, collating"
    )
    print(format_table(stalls))
    write_json(
        args.out,
        {
            "nodes": rows_out,
            "summary": summary,
            "stalls": stalls,
            "ranks": {name: results[name]["stalls"] for name in ("tabloader", "dataloader")},
            "leader": cost,
            "args": {k: v for k, v in vars(args).items() if k != "func"},
        },
    )
    return 0 if ok else 1
