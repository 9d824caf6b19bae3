"""``bench e2e``'s default mode: four training jobs as users launch them (:mod:`.launched`).

Scenarios, each four jobs at once on every row of ``--images`` generated JPEGs (about 500x375),
batch ``--batch-size`` (64), with no simulated step and with each of ``--steps``:

* ``recipe``: the training recipe, ``RandomResizedCrop(224), RandomHorizontalFlip()``, each job
  its own seed;
* ``eval``: the evaluation recipe, ``image_size = 224`` (``Resize(224), CenterCrop(224)``);
* ``eight``: eight jobs of the training recipe (each its own seed).

Competitors: tabloader (four ``train_tabloader.py``, the first one starting the catalog's
service), four ``train_dataloader.py`` with ``DataLoader(num_workers=2)`` and with
``num_workers`` = the machine's cores (one competitor where those are equal).

Targets (issue 49; the no-step runs, tabloader against as many ``DataLoader(num_workers=2)``
processes):

* ``recipe``: wall <= 0.40x (the four interpreters' imports are in both); the span from the
  last loader built to the last batch <= 0.25x; CPU-seconds per delivered image <= 0.35x;
* ``eval``: wall <= 0.30x;
* ``eight``: wall <= 0.30x;
* both, a guard that sharing works: the service's decodes <= 1.25x the images (four separate
  decodes would be 4x; the jobs' interpreters come up to 0.5 s apart, so the first decodes
  rows the others read later, a few evicted by then from the default 1 GiB cache).
"""

from __future__ import annotations

import argparse

from benchmarks import write_json
from benchmarks.launched import Scenario, ScenarioRun, TargetRow, check, measure, pick, report

__all__ = ["LAUNCHED_SCENARIOS", "TARGETS", "run_launched", "targets"]

LAUNCHED_SCENARIOS = {
    "recipe": Scenario("recipe", 4, "train"),
    "eval": Scenario("eval", 4, "eval"),
    "eight": Scenario("eight", 8, "train"),
}
TARGETS = {
    "recipe_wall": 0.40,
    "recipe_span": 0.25,
    "recipe_cpu": 0.35,
    "eval_wall": 0.30,
    "eight_wall": 0.30,
}
DECODES = 1.25  # a guard that sharing works: the four interpreters come up to 0.5 s apart,
# so the first job decodes rows the others want later, some of them evicted by then (the
# zygote mode's ``late`` scenario measures that against Belady's MIN)


def targets(runs: list[ScenarioRun], images: int) -> list[TargetRow]:
    """The target rows of the no-step runs."""
    rows: list[TargetRow] = []
    for name, scenario in LAUNCHED_SCENARIOS.items():
        x = f"{name} x{scenario.jobs}"
        ours, theirs = pick(runs, name, "tabloader"), pick(runs, name, "dataloader(2)")
        if ours is None:
            continue
        service = ours["service"]
        assert service is not None  # a tabloader run's
        check(rows, f"{x}: service decodes / images", service["decodes"] / images, DECODES)
        if theirs is None:
            continue
        wall = ours["wall_s"] / theirs["wall_s"]
        check(rows, f"{x}: wall / dataloader(2) wall", wall, TARGETS[f"{name}_wall"])
        if name == "recipe":
            check(
                rows,
                "recipe x4: span / dataloader(2) span",
                ours["span_s"] / theirs["span_s"],
                TARGETS["recipe_span"],
            )
            cpu = ours["cpu_ms_per_image"] / theirs["cpu_ms_per_image"]
            check(rows, "recipe x4: CPU per image / dataloader(2)'s", cpu, TARGETS["recipe_cpu"])
    return rows


def run_launched(args: argparse.Namespace) -> int:
    """Run the launched scenarios, print the tables and write JSON."""
    names = [s for s in (args.scenarios or "recipe,eval,eight").split(",") if s]
    unknown = sorted(set(names) - set(LAUNCHED_SCENARIOS))
    if unknown or not names:
        raise SystemExit(
            f"Unknown scenario(s) {', '.join(unknown) or '(none given)'} in --scenarios for "
            f"--mode launched: use {', '.join(LAUNCHED_SCENARIOS)}."
        )
    args.images = args.images or 3000
    steps = [float(s) for s in args.steps.split(",") if s]
    repeat = args.repeat
    if args.quick:
        args.images, steps, repeat = min(args.images, 400), steps[:1], 1
    batch_size = 64 if args.batch_size is None else args.batch_size
    info, n, runs = measure(
        args,
        [LAUNCHED_SCENARIOS[s] for s in names],
        steps=steps,
        size=args.recipe_size,
        batch_size=batch_size,
        repeat=repeat,
    )
    checked = targets(runs, n)
    report(
        info,
        f"{n} images (about 500x375 JPEGs), batch {batch_size}, recipes at {args.recipe_size}; "
        "each job a fresh `python train.py` launched at once, imports and the auto-started "
        f"service inside the wall; median of {repeat} run(s)",
        runs,
        checked,
    )
    write_json(
        args.out,
        {
            "benchmark": "e2e",
            "mode": "launched",
            "machine": info,
            "args": {k: v for k, v in vars(args).items() if k != "child"},
            "runs": runs,
            "targets": checked,
        },
    )
    return 0
