"""Importance benchmark: SHADE's experiment, side by side with uniform jobs, on real data.

SHADE (FAST'23) trains more on the samples that matter: per-sample importance from the job's
own losses, epochs drawn by it with repetitions, and a cache that keeps the important
samples (4.5x LRU's hit ratio at 10% of the working set, in their paper). This runs the same
experiment on data nobody here made, scikit-learn's digits (1,797 labeled 8x8 images shipped
in the wheel; 80/20 split per class by a fixed seed, as ``bench accuracy``), with a small MLP
(64-128-10, Adam) trained in this process on the rows the sampler hands out.

1. **Training, importance vs uniform** (``--seeds`` runs of each, ``--epochs`` each): the
   importance arm is a job with ``importance = 'loss'`` that reports every batch's per-row
   losses (``DependentSampler.report``, what ``JobDataset.report`` reaches); the uniform arm a
   plain job. Both train with the plain mean loss of their batches, as SHADE does. Beside the
   trained job, two plain jobs read the same rows in the same sampler (they only draw), so
   each round couples the importance job to a uniform leader. Reported: test accuracy per
   epoch (mean over seeds), the epochs the importance arm needs to reach the uniform arm's
   final mean, and the final difference against the seeds' noise (Welch, as ``bench
   accuracy``).
2. **Sharing without bias** (the same runs): per round, how often the importance job drew
   the row its leader drew, against the maximal coupling ``sum_x min(p_x, q_x)`` of that round
   (``p`` uniform over the leader's remaining rows, ``q`` the importance job's epoch
   distribution); and each plain job's uniformity: a chi-square over a 10 x 10 table of (row
   id decile, position decile) of its epochs (81 degrees of freedom; a uniform permutation
   stays under the 99% point 113.5 about 99 times in 100).
3. **Cache hit ratio** on the first importance run's own request stream, with a cache of
   10%, 20% and 50% of the working set: LRU
   (:class:`~tabloader.engine._arena.eviction.LeastRecent`), tabloader's policy
   (:data:`~tabloader.engine._arena.eviction.ARENA_POLICY`, the object the arena ranks by, with each
   row's future uses = its expected draws left, as ``DependentSampler.expected_draws`` gives the
   arena): once alone (no lookahead, SHADE's importance cache) and once as the engine runs it (next
   uses known inside the sampler's lookahead first); and Belady's MIN (offline, the bound).
4. **Through the service** (``--no-service`` skips it): the digits as 16x16 JPEGs in an image
   folder, one importance job reporting losses beside two plain jobs, three threads of one
   process reading ``JobDataset`` through one auto-started loader service: decodes against
   the union of the jobs' rows, and each plain job's uniformity statistic.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
from pyroaring import BitMap

from benchmarks import format_table, positive_int, write_json
from benchmarks.accuracy import compare, load_digits, summarize
from tests.support import cachesim

__all__ = [
    "add_arguments",
    "agreement_bound",
    "run",
    "uniformity",
]

SPLIT_SEED = 0
TEST_FRACTION = 0.2
BATCH = 64
CHI2_99_81 = 113.51  # the 99% point of chi-square with 81 degrees of freedom
CACHE_FRACTIONS = (0.1, 0.2, 0.5)
QUICK_SERVED = 500  # --quick: digits written and served in part 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m benchmarks importance``."""
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 seeds, 3 epochs")
    parser.add_argument("--epochs", type=positive_int, default=15, help="epochs per model")
    parser.add_argument("--seeds", type=positive_int, default=5, help="runs per arm")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument(
        "--no-service", action="store_true", help="skip part 4 (the three jobs through the service)"
    )
    parser.add_argument("--out", default="bench-results/importance.json", help="JSON output")


# -- data ------------------------------------------------------------------------------------------
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 features in [0, 1] and labels: (x_train, y_train, x_test, y_test)."""
    images, labels = load_digits()
    rng = np.random.default_rng(SPLIT_SEED)
    test = np.zeros(len(labels), bool)
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        test[members[: round(TEST_FRACTION * len(members))]] = True
    x = images.reshape(len(images), -1).astype(np.float32) / 255
    return x[~test], labels[~test], x[test], labels[test]


# -- statistics ------------------------------------------------------------------------------------
def uniformity(epochs: list[np.ndarray], ids: np.ndarray) -> float:
    """Chi-square of the 10 x 10 table of (id decile, position decile) over ``epochs`` (each a
    permutation of ``ids``): about 81 for uniform permutations, far more for a biased order."""
    n = len(ids)
    rank = np.searchsorted(ids, np.concatenate(epochs)) * 10 // n
    pos = np.tile(np.arange(n) * 10 // n, len(epochs))
    table = np.zeros((10, 10))
    np.add.at(table, (rank, pos), 1)
    expected = np.outer(table.sum(1), table.sum(0)) / table.sum()
    return float(((table - expected) ** 2 / expected).sum())


def agreement_bound(leader: np.ndarray, ids: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Per round of one epoch of a uniform ``leader`` (its rows in order, a permutation of
    ``ids``): ``sum_x min(p_x, q_x)`` with ``p`` uniform over the leader's rows not drawn yet
    (``q`` aligned with ``ids``): the most often any coupling makes the two draws agree."""
    n = len(ids)
    qs = q[np.searchsorted(ids, leader)]  # q of the leader's rows in its order
    out = np.empty(n)
    for t in range(n):  # the rows left at round t are leader[t:]
        out[t] = np.minimum(qs[t:], 1.0 / (n - t)).sum()
    return out


# -- one training run ------------------------------------------------------------------------------
def _train(
    importance: bool, seed: int, args: argparse.Namespace, data: tuple[np.ndarray, ...]
) -> dict[str, Any]:
    """Train one MLP on the rows one job draws (beside two plain jobs in the same sampler)."""
    import torch
    from torch import nn

    from tabloader.catalog import JobSpec
    from tabloader.sampling import DependentSampler

    x_train, y_train, x_test, y_test = (torch.from_numpy(a) for a in data)
    n = len(x_train)
    ids = np.arange(n, dtype=np.int64)
    sampler = DependentSampler(seed=seed)
    spec = JobSpec.from_options({"importance": "loss"} if importance else {})
    sampler.add_job("train", BitMap(ids), spec)
    sampler.add_job("u1", BitMap(ids))
    sampler.add_job("u2", BitMap(ids))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    accuracy, rows, probs, agree, bound = [], [], [], [], []
    plain: dict[str, list[np.ndarray]] = {"u1": [], "u2": []}
    for _ in range(args.epochs):
        q = np.full(n, 1 / n)
        drawn: dict[str, list[np.ndarray]] = {name: [] for name in ("train", "u1", "u2")}
        model.train()
        for start in range(0, n, BATCH):
            got = sampler.sample_many(["train", "u1", "u2"], min(BATCH, n - start))
            if importance and start == 0:  # the epoch's distribution, frozen at its start
                left = sampler.expected_draws(ids)
                q = left / left.sum()
            for name, r in got.items():
                drawn[name].append(r)
            batch = got["train"]
            losses = loss_fn(model(x_train[batch]), y_train[batch])
            opt.zero_grad()
            losses.mean().backward()
            opt.step()
            if importance:
                sampler.report("train", batch, losses.detach().numpy())
        probs.append(q)
        epoch = {name: np.concatenate(r) for name, r in drawn.items()}
        rows.append(epoch["train"])
        agree.append(float(np.mean(epoch["train"] == epoch["u1"])))
        bound.append(float(agreement_bound(epoch["u1"], ids, q).mean()))
        for name in plain:
            plain[name].append(epoch[name])
        model.eval()
        with torch.no_grad():
            accuracy.append(float((model(x_test).argmax(1) == y_test).float().mean()))
    return {
        "accuracy": accuracy,
        "rows": np.concatenate(rows),
        "probs": probs,
        "agreement": float(np.mean(agree)),
        "bound": float(np.mean(bound)),
        "uniformity": {name: uniformity(e, ids) for name, e in plain.items()},
        "ids": ids,
    }


# -- through the service ---------------------------------------------------------------------------
def _service(work: Path, epochs: int, images_kept: int | None = None) -> dict[str, Any]:
    """One importance job reporting losses beside two plain jobs, through one service."""
    import torch

    from benchmarks._procs import ServiceProcess
    from benchmarks.accuracy import write_digits
    from tabloader import catalog
    from tabloader.service import RemoteLoader
    from tabloader.torch import JobDataset

    images, labels = load_digits()
    images, labels = images[:images_kept], labels[:images_kept]  # --quick: the first ones
    folder = work / "digits"
    write_digits(images, labels, folder, 16)
    root = work / "catalog"
    with catalog.open_catalog(root, create=True) as cat:
        cat.sql(f"CREATE DATASET digits FROM '{folder}' FORMAT imagefolder")
        for name, extra in (("imp", ", importance = 'loss'"), ("u1", ""), ("u2", "")):
            cat.sql(
                f"REGISTER JOB {name} SELECT image, label FROM digits "
                f"WHERE path LIKE '%/train/%' WITH (batch_size = {BATCH}, image_size = 16{extra})"
            )
        union = cat.sql("SELECT _id FROM digits WHERE path LIKE '%/train/%'").num_rows
    orders: dict[str, list[np.ndarray]] = {"u1": [], "u2": []}
    errors: list[BaseException] = []

    def read(ds: JobDataset) -> None:
        try:
            torch.manual_seed(0)
            weights = torch.zeros(16 * 16 * 3, 10, requires_grad=True)
            opt = torch.optim.SGD([weights], lr=0.1)
            epoch: list[np.ndarray] = []
            for batch in ds:
                if ds.job == "imp":
                    x = batch["image"].float().reshape(len(batch["label"]), -1) / 255
                    losses = torch.nn.functional.cross_entropy(
                        x @ weights, batch["label"], reduction="none"
                    )
                    opt.zero_grad()
                    losses.mean().backward()  # type: ignore[no-untyped-call]
                    opt.step()
                    ds.report(batch["_id"], losses.detach())
                else:
                    epoch.append(batch["_id"].numpy())
                    if sum(len(e) for e in epoch) >= union // BATCH * BATCH:
                        orders[ds.job].append(np.concatenate(epoch))
                        epoch = []
        except BaseException as exc:  # reported by the parent
            errors.append(exc)

    with ServiceProcess(root, cache_bytes=64 << 20, workers=2, log=work / "service.log") as svc:
        remote = RemoteLoader(root, start=False)
        names = ("imp", "u1", "u2")
        datasets = [JobDataset(name, loader=remote, epochs=epochs) for name in names]
        threads = [threading.Thread(target=read, args=(ds,)) for ds in datasets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = [ds.stats() for ds in datasets]
        for ds in datasets:
            ds.close()
        remote.close()
        decodes = int(svc.stats()["decodes"])
    if errors:
        raise errors[0]
    return {
        "decodes": decodes,
        "requests": sum(int(st["requests"]) for st in stats),
        "union": union,
        "uniformity": {
            name: uniformity([np.asarray(o) for o in e], np.sort(e[0]))
            for name, e in orders.items()
        },
    }


# -- the run -------------------------------------------------------------------------------------
def _first_reaching(curve: list[float], target: float) -> int | None:
    return next((i + 1 for i, a in enumerate(curve) if a >= target), None)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print the tables and write the JSON."""
    from benchmarks._cpu import cpu_line

    if args.quick:
        args.seeds, args.epochs = min(args.seeds, 2), min(args.epochs, 3)
    data = _split()
    seeds = list(range(1, args.seeds + 1))
    arms = {
        "importance": [_train(True, s, args, data) for s in seeds],
        "uniform": [_train(False, s, args, data) for s in seeds],
    }
    print(cpu_line())
    print(
        f"digits: {len(data[0])} train / {len(data[2])} test, MLP 64-128-10, Adam lr {args.lr}, "
        f"batch {BATCH}, {args.epochs} epochs, {args.seeds} seeds per arm"
    )
    curves = {arm: np.mean([r["accuracy"] for r in runs], axis=0) for arm, runs in arms.items()}
    print(
        format_table(
            [
                {
                    "epoch": e + 1,
                    "importance acc %": f"{100 * curves['importance'][e]:.2f}",
                    "uniform acc %": f"{100 * curves['uniform'][e]:.2f}",
                }
                for e in range(args.epochs)
            ]
        )
    )
    finals = {arm: [r["accuracy"][-1] for r in runs] for arm, runs in arms.items()}
    diff = compare(finals["importance"], finals["uniform"])
    target = float(curves["uniform"][-1])
    reach = _first_reaching(list(curves["importance"]), target)
    print(
        f"\nimportance reaches the uniform arm's final {100 * target:.2f}% at epoch "
        f"{reach if reach else 'never'} (uniform: {args.epochs}); final difference "
        f"{diff['diff_pp']:+.2f} pp, noise (Welch SE) {diff['se_pp']:.2f} pp\n"
    )
    imp = arms["importance"]
    agreement = float(np.mean([r["agreement"] for r in imp]))
    bound = float(np.mean([r["bound"] for r in imp]))
    chi = [v for r in imp for v in r["uniformity"].values()]
    print(
        format_table(
            [
                {
                    "rounds": "importance job vs its uniform leader",
                    "agreement": f"{agreement:.4f}",
                    "coupling bound": f"{bound:.4f}",
                    "ratio": f"{agreement / bound:.3f}",
                }
            ]
        )
    )
    print(
        f"plain jobs beside it: uniformity chi-square (81 dof, 99% point {CHI2_99_81}): "
        f"median {np.median(chi):.1f}, max {max(chi):.1f}, over {len(chi)} jobs x epochs\n"
    )
    first = imp[0]
    hits = []
    for fraction in CACHE_FRACTIONS:
        capacity = max(1, int(fraction * len(first["ids"])))
        h = cachesim.hit_ratios(first["rows"], first["probs"], first["ids"], capacity)
        hits.append(
            {
                "cache": f"{fraction:.0%} ({capacity} rows)",
                "LRU hits": f"{h['LRU']:.3f}",
                "expected draws": f"{h['expected draws']:.3f}",
                "+ lookahead (tabloader)": f"{h['tabloader']:.3f}",
                "MIN hits": f"{h['Belady MIN']:.3f}",
                "expected / LRU": f"{h['expected draws'] / h['LRU']:.2f}" if h["LRU"] else "inf",
                "tabloader / LRU": f"{h['tabloader'] / h['LRU']:.2f}" if h["LRU"] else "inf",
            }
        )
    print(format_table(hits))
    payload: dict[str, Any] = {
        "cpu": cpu_line(),
        "curves": {a: c.tolist() for a, c in curves.items()},
        "final": {a: summarize(f) for a, f in finals.items()},
        "compare": diff,
        "reach_epoch": reach,
        "agreement": [r["agreement"] for r in imp],
        "bound": [r["bound"] for r in imp],
        "uniformity": chi,
        "hits": hits,
    }
    if not args.no_service:
        with tempfile.TemporaryDirectory(prefix="tabloader-importance-") as tmp:
            kept = QUICK_SERVED if args.quick else None
            service = _service(Path(tmp), 2 if args.quick else 3, kept)
        payload["service"] = service
        print(
            f"\nthrough the service (1 importance job + 2 plain jobs, {service['union']} rows): "
            f"{service['requests']} rows asked for, {service['decodes']} decodes: decodes / union "
            f"{service['decodes'] / service['union']:.3f}; plain jobs' "
            "uniformity chi-square "
            + ", ".join(f"{k} {v:.1f}" for k, v in service["uniformity"].items())
        )
    write_json(args.out, payload)
    return 0 if math.isfinite(diff["diff_pp"]) else 1
