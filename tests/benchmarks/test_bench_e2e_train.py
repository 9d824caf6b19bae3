"""``python -m benchmarks e2e`` and ``bench train`` at tiny sizes: their JSON, counts, and clean-up.

Counts only (decodes, rows, bytes copied): never a timing. Each benchmark runs as the CLI in a
subprocess with a timeout, so a hang fails the test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import e2e, e2e_children, train
from benchmarks._procs import run_one
from benchmarks.e2e_targets import targets as e2e_targets
from tabloader.engine._arena.shm import shm_available
from tabloader.service._protocol import socket_path

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm on this system")

TIMEOUT = 600
ROWS = 48  # generated images
SIZE = 32  # pixels


def bench(tmp_path: Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks", name),
            *("--images", str(ROWS), "--workers", "2", "--batch-size", "8"),
            *("--data", str(tmp_path / "data"), "--out", str(out), *args),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    data["stdout"] = proc.stdout
    return data


def assert_cleaned_up(tmp_path: Path, service_pids: list[int]) -> None:
    """The services stopped and removed their socket (their memory has no name); no process
    of the run is left."""
    assert service_pids
    for pid in service_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    catalog_dir = next((tmp_path / "data").glob("catalog-*"))
    assert not socket_path(catalog_dir).exists()
    mine = str(tmp_path).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            assert mine not in cmdline, cmdline.replace(b"\0", b" ")


def assert_stalls(result: dict, row: dict, *, loader: bool) -> None:
    """A competitor's stall accounting: every job waited for its first batch, and its waiting
    and computing are parts of its epoch; the loader's (none for DataLoaders) read and
    decoded; the printed line is the JSON's."""
    for job in result["jobs"].values():
        assert job["wait_s"] > 0
        assert job["compute_s"] >= 0
        if "seconds" in job:  # the epoch, as the job timed its loop
            assert job["wait_s"] + job["compute_s"] <= job["seconds"] * 1.01 + 0.01
    assert row["wait_s"] == round(sum(j["wait_s"] for j in result["jobs"].values()), 3)
    assert row["compute_s"] == round(sum(j["compute_s"] for j in result["jobs"].values()), 3)
    assert len(row["per job wait/compute"].split()) == len(result["jobs"])
    if loader:
        seconds = result["dataset_s"]
        assert seconds["read_s"] > 0
        assert seconds["decode_s"] > 0
        assert seconds["collate_s"] >= 0
        assert {k: row[k] for k in seconds} == seconds
    else:
        assert result["dataset_s"] is None
        assert row["read_s"] == row["decode_s"] == row["collate_s"] == ""


PROBE = """
import json, multiprocessing, sys
spec = json.loads(sys.argv[2])
method = multiprocessing.get_start_method()
print(json.dumps({"name": __name__, "argv1": sys.argv[1], "method": method}))
if spec.get("fail"):
    raise SystemExit("the probe failed on purpose")
"""


def test_a_benchmark_child_runs_as_python_m_module_would(tmp_path, monkeypatch):
    """Forked from the benchmark's zygote, a child still runs its module as ``__main__`` with
    ``--child JSON``, with the default start method a fresh interpreter has (a forkserver's
    children inherit "forkserver": a DataLoader's workers would not fork), and a failure is
    raised with its output."""
    (tmp_path / "tl_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fresh = subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    ).stdout.strip()
    out = json.loads(run_one("tl_probe", {"fail": False}).strip().splitlines()[-1])
    assert out == {"name": "__main__", "argv1": "--child", "method": fresh}
    with pytest.raises(RuntimeError, match="(?s)child failed:.*the probe failed on purpose"):
        run_one("tl_probe", {"fail": True})


@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory) -> tuple[dict, Path]:
    """One quick ``bench e2e`` run of its shared-set scenarios (same, speeds, recipe,
    recipe-eval) and of ``scale``, which the tests below read in parts: a run costs ~5 CPU-s
    before its first job (the benchmark's interpreter, its jobs' zygote, the overhead probe)."""
    tmp_path = tmp_path_factory.mktemp("e2e")
    data = bench(
        tmp_path,
        "e2e",
        *("--mode", "zygote", "--scenarios", "same,speeds,recipe,recipe-eval,scale"),
        *("--image-size", str(SIZE), "--recipe-size", str(SIZE), "--step", "0"),
        *("--speeds-rows", "24", "--speeds-step", "0.01"),
        *("--overhead-batch", "8", "--overhead-size", str(SIZE), "--overhead-samples", "5"),
        *("--overhead-settle", "0.01", "--repeat", "1"),  # repeats: test_e2e_repeats_report_*
        # scale at --quick's sizes (--quick itself would resize the other scenarios too)
        *("--scale-rows", "3000", "--scale-step", "0.002", "--scale-batch", "32"),
        *("--scale-caches", "0.05", "--scale-data", str(tmp_path / "tiny")),
    )
    return data, tmp_path


@pytest.mark.xdist_group("bench_e2e")  # one worker, one run of the fixture
def test_e2e_counts_decodes_rows_and_copies_and_cleans_up(e2e_run):
    data, tmp_path = e2e_run
    assert "service decodes / union" in data["stdout"]
    assert "stalls (the reported runs)" in data["stdout"]
    assert set(data["runs"]) == {"same", "speeds", "recipe", "recipe-eval"}
    stalls = {(row["scenario"], row["competitor"]): row for row in data["stalls"]}
    assert len(stalls) == len(data["stalls"]) == 12  # a line per scenario and competitor
    pids = []
    for name in ("same", "speeds"):
        run = data["runs"][name]
        sets, union = run["sets"], run["union"]
        assert set(run["results"]) == {"service", "dataloader", "threads"}
        for competitor, result in run["results"].items():
            delivered = [result["jobs"][f"j{i}"]["rows"] for i in range(len(sets))]
            assert delivered == sets, (name, competitor)  # every job: one whole epoch
            assert result["wall_s_runs"] == [result["wall_s"]]
            assert result["wall_s"] > 0
            assert_stalls(result, stalls[name, competitor], loader=competitor != "dataloader")
        assert run["results"]["dataloader"]["decodes"] == sum(sets)
        service = run["results"]["service"]
        assert union <= service["decodes"] <= 1.05 * union
        for competitor in ("service", "threads"):  # replayed from their own access logs
            belady = run["results"][competitor]["belady"]
            assert belady["capacity_rows"] > 0
            assert union <= belady["decodes_unpinned"] <= belady["decodes"] <= sum(sets)
        copies = service["copies"]
        assert copies["images"] == sum(sets)
        assert copies["prepared_bytes"] == sum(sets) * SIZE * SIZE * 3
        assert copies["copied_bytes"] == copies["prepared_bytes"]  # one copy, counted
        pids += service["service_pids"]
    assert data["runs"]["speeds"]["fastest_alone_rows_per_s"] > 0
    pids += data["runs"]["speeds"]["fastest_alone"]["service_pids"]
    targets = {(t["scenario"], t["target"]): t for t in data["targets"]}
    for scenario in ("same", "speeds"):
        assert targets[scenario, "service decodes / union"]["result"] == "PASS"
        assert targets[scenario, "service bytes copied / prepared, per image"]["value"] == 1.0
    assert {"service wall / dataloader wall", "service wall / threads wall"} <= {
        t for s, t in targets if s == "same"
    }
    assert ("speeds", "service fastest job rows/s / alone") in targets
    assert all(t["result"] in ("PASS", "FAIL") for t in data["targets"] if t["limit"] != "report")
    overhead = data["overhead"]
    assert overhead["shape"] == [8, SIZE, SIZE, 3]
    assert overhead["samples"] == 5
    assert 0 < overhead["p50_us"] <= overhead["p99_us"]
    pids += overhead["service_pids"]
    assert_cleaned_up(tmp_path, pids)


@pytest.mark.parametrize(
    ("walls", "median"), [([3.0], 3.0), ([4.0, 2.0], 2.0), ([5.0, 1.0, 3.0], 3.0)]
)
def test_e2e_repeats_report_the_median_run_and_every_runs_wall_and_services(walls, median):
    """``--repeat n``: the run of median wall time (of two, the lower), every run's wall time
    in order, and the service processes of every run (the clean-up checks them all)."""
    runs = [{"wall_s": w, "decodes": i, "service_pids": [100 + i]} for i, w in enumerate(walls)]
    got = e2e.median_run(runs)
    assert got["wall_s"] == median
    assert got["decodes"] == walls.index(median)  # that run's own counts
    assert got["wall_s_runs"] == walls
    assert got["service_pids"] == [100 + i for i in range(len(walls))]


@pytest.mark.xdist_group("bench_e2e")
def test_e2e_recipe_scenarios_count_shared_decodes_and_cached_bytes(e2e_run):
    """``recipe`` and ``recipe-eval``: every job gets its epoch, the service and the threads
    decode each row once (the evaluation job reads the training jobs' decode), the DataLoaders
    once per job; the arena's bytes per image: the aspect-kept decode vs the center crop."""
    data, tmp_path = e2e_run
    pids = []
    for name in ("recipe", "recipe-eval"):
        run = data["runs"][name]
        sets, union = run["sets"], run["union"]
        assert sets == [ROWS] * 4
        assert union == ROWS
        results = run["results"]
        assert set(results) == {"service", "dataloader", "threads"}
        for competitor, result in results.items():
            delivered = [result["jobs"][f"j{i}"]["rows"] for i in range(4)]
            assert delivered == sets, (name, competitor)
        assert results["service"]["decodes"] == results["threads"]["decodes"] == union
        assert results["dataloader"]["decodes"] == sum(sets)
        copies = results["service"]["copies"]  # the job's images, out of shared memory
        assert copies["images"] == sum(sets)
        assert copies["copied_bytes"] == sum(sets) * SIZE * SIZE * 3
        # the service augments: what it prepared for a job is its crops, copied out once
        assert copies["prepared_bytes"] == copies["copied_bytes"]
        kept = results["service"]["cache"]
        assert 0 < kept["entries"] <= union
        assert kept["size_bytes"] / kept["entries"] > SIZE * SIZE * 3
        pids += results["service"]["service_pids"]
    alone = data["runs"]["recipe-eval"]["center_crop_alone"]
    assert alone["jobs"]["j0"]["rows"] == ROWS
    assert alone["decodes"] == ROWS
    assert alone["cache"]["size_bytes"] == alone["cache"]["entries"] * SIZE * SIZE * 3
    assert data["runs"]["recipe"]["center_crop_alone"] is None
    pids += alone["service_pids"]
    per_image = data["recipe"]["bytes_per_image"]
    service = data["runs"]["recipe"]["results"]["service"]["cache"]
    assert per_image == {
        "shared_decode": service["size_bytes"] / service["entries"],
        "center_crop": SIZE * SIZE * 3,
    }
    assert "arena bytes per cached image (service)" in data["stdout"]
    torchvision = e2e_children.torchvision_recipe(SIZE) is not None
    which = "torchvision.transforms.v2" if torchvision else "torchvision not installed"
    assert which in data["recipe"]["transforms"]
    assert data["recipe"]["transforms"] in data["stdout"]
    targets = {(t["scenario"], t["target"]): t for t in data["targets"]}
    for scenario in ("recipe", "recipe-eval"):
        assert targets[scenario, "service decodes / union"]["result"] == "PASS"
    assert targets["recipe", "service wall / dataloader wall"]["limit"] == "<= 0.35"
    assert targets["recipe", "service wall / dataloader wall"]["result"] in ("PASS", "FAIL")
    report = targets["recipe-eval", "service arena bytes per cached image (center crop, alone)"]
    assert report["value"] == SIZE * SIZE * 3
    rows = {(r["scenario"], r["competitor"]): r for r in data["rows"]}
    assert rows["recipe", "service"]["cache B/img"] == per_image["shared_decode"]
    assert rows["recipe", "dataloader"]["cache B/img"] == ""
    assert_cleaned_up(tmp_path, pids)


@pytest.mark.xdist_group("bench_e2e")
def test_scale_counts_decodes_against_the_union_and_belady(e2e_run):
    """``--scenarios scale`` at ``--quick``'s sizes (3,000 tiny JPEGs, 32 a batch): each cell's
    decodes against the union, Belady's MIN of its own requests and the coupled bound."""
    data, _ = e2e_run
    scale = data["scale"]
    assert [(r["cache"], r["start"]) for r in scale["table"]] == [
        ("5%", s) for s in ("same", "late", "speeds")
    ]
    for r in scale["table"]:
        run = scale["runs"][f"5% {r['start']}"]
        assert r["union"] == 3000
        assert run["sets"] == [3000, 1500, 1980, 3000]  # all; label < 50; label % 3 <> 0; all
        assert [j["rows"] for j in run["jobs"].values()] == run["sets"]
        assert r["decodes"] >= r["MIN"] >= r["union"]
        assert r["MIN"] == run["belady"]["decodes"] >= run["belady"]["decodes_unpinned"]
        assert r["decodes/MIN"] == round(r["decodes"] / r["MIN"], 3)
        assert r["cache rows"] < 3000  # the cache holds less than the union: it evicts
        assert r["service rss MiB"] >= r["service anon MiB"] > 0
        assert r["REGISTER ms"] > 0
        if r["start"] == "speeds":  # the jobs' steps set their paces: no bound
            assert r["coupled/union"] == "-"
            assert run["coupled"] is None
        elif r["start"] == "same":  # coupled and paced, every shared row is met while cached
            assert run["coupled"] == r["union"]
        else:  # the late job meets the others' rows from half-way: more than the union
            assert r["union"] < run["coupled"] < sum(run["sets"])
        assert r["arena MiB"] > 0
    assert [(t["scenario"], t["target"]) for t in scale["targets"]] == [
        ("scale 5% same", "service decodes / Belady's MIN"),
        ("scale 5% same", "service decodes / union"),
        ("scale 5% late", "service decodes / Belady's MIN"),
        ("scale 5% late", "service decodes / union"),
        ("scale 5% speeds", "service decodes / Belady's MIN"),
        ("scale REGISTER", "ms a job through the service (median of the cells)"),
    ]
    assert all(t["result"] in ("PASS", "FAIL") for t in scale["targets"])
    assert "decodes/MIN" in data["stdout"]


def test_e2e_recipe_dataloader_crops_flips_and_resizes_the_drawn_box(monkeypatch):
    """The DataLoaders' Pillow recipe applies ``Augmenter.draw``'s box and flip: on an image
    whose red is its x and green its y, the output's center is the box's center, and red
    falls from left to right exactly where the draw flipped."""
    import io

    import numpy as np
    from PIL import Image

    from tabloader.engine._prepare.augment import Augmenter

    monkeypatch.setattr(e2e_children, "torchvision_recipe", lambda size: None)
    h, w = 300, 400
    pixels = np.zeros((h, w, 3), np.uint8)
    pixels[..., 0] = np.linspace(0, 255, w)[None, :]
    pixels[..., 1] = np.linspace(0, 255, h)[:, None]
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")  # no DCT draft: the full size
    text = "RandomResizedCrop(32), RandomHorizontalFlip()"
    ds = e2e_children.RecipeDataset("", "imgs", [], {"augment": text, "seed": 7})
    assert "torchvision not installed" in ds.transforms
    aug = Augmenter(text, 7)
    flips = []
    for row in range(40):
        out = ds.prepare(png.getvalue(), row).numpy()
        assert out.shape == (32, 32, 3)
        (top, left, ch, cw), flip = aug.draw((h, w), 0, row)
        center = out[15:17, 15:17].mean(axis=(0, 1))
        assert center[0] == pytest.approx((left + cw / 2) * 255 / (w - 1), abs=4 + 255 / cw)
        assert center[1] == pytest.approx((top + ch / 2) * 255 / (h - 1), abs=4 + 255 / ch)
        assert (int(out[16, 0, 0]) > int(out[16, -1, 0])) == flip
        flips.append(flip)
    assert 10 <= sum(flips) <= 30  # both ways, about half each
    assert np.array_equal(ds.prepare(png.getvalue(), 3), ds.prepare(png.getvalue(), 3))


@pytest.mark.parametrize("scenarios", ["recipe,recipe-evl", ","])
def test_e2e_rejects_unknown_scenarios(scenarios):
    with pytest.raises(SystemExit, match="Unknown scenario.* in --scenarios: use same, "):
        e2e.run(parsed(e2e, "--mode", "zygote", "--scenarios", scenarios))
    with pytest.raises(SystemExit, match="in --scenarios for --mode launched: use recipe, eval"):
        e2e.run(parsed(e2e, "--scenarios", scenarios.replace("recipe,", "recipe,same")))


def test_e2e_late_is_checked_against_belady():
    """In ``late`` the service's decodes are checked against Belady's MIN on its requests;
    the union is out of reach for any cache of that size (MIN is above it), so it is reported,
    not checked."""
    service = {
        "decodes": 120,
        "belady": {"capacity_rows": 40, "decodes": 110, "decodes_unpinned": 105},
        "copies": {"copied_bytes": 1, "prepared_bytes": 1},
        "jobs": {},
    }
    runs = {"late": {"union": 100, "results": {"service": service}, "fastest_alone_rows_per_s": 0}}
    overhead = {"p50_us": 1.0, "p99_us": 2.0}
    targets = {t["target"]: t for t in e2e_targets(runs, overhead)}
    union = targets["service decodes / union"]
    assert (union["value"], union["result"]) == (1.2, "")  # no PASS or FAIL
    bound = targets["Belady's MIN / union (40-row arena, service's requests and pins)"]
    assert bound["value"] == 1.1
    check = targets["service decodes / Belady's MIN"]
    assert check["value"] == pytest.approx(120 / 110)
    assert check["result"] == "FAIL"
    service["decodes"] = 112
    targets = {t["target"]: t for t in e2e_targets(runs, overhead)}
    assert targets["service decodes / Belady's MIN"]["result"] == "PASS"


def test_train_counts_decodes_and_epochs_and_cleans_up(tmp_path):
    data = bench(tmp_path, "train", *("--jobs", "2", "--image-size", str(SIZE)))
    assert "JOADER" in data["stdout"]
    assert "stalls: jobs' seconds waiting for data vs training" in data["stdout"]
    assert data["reference"]["dataloader/service"] == pytest.approx(67.9 / 37.6)
    assert [r["jobs"] for r in data["runs"]] == [2]
    stalls = {(row["jobs"], row["competitor"]): row for row in data["stalls"]}
    assert list(stalls) == [(2, "service"), (2, "dataloader")]
    pids = []
    for run in data["runs"]:
        jobs = run["jobs"]
        assert ROWS <= run["service"]["decodes"] <= 1.05 * ROWS  # one epoch of a shared set
        assert run["dataloader"]["decodes"] == jobs * ROWS
        for mode in ("service", "dataloader"):
            assert len(run[mode]["epoch_s"]) == jobs
            assert all(s > 0 for s in run[mode]["epoch_s"])
            assert run[mode]["model"] == "tiny-cnn" or run[mode]["device"].startswith("cuda")
            assert list(run[mode]["jobs"]) == [f"train{i}" for i in range(jobs)]
            assert all(j["compute_s"] > 0 for j in run[mode]["jobs"].values())  # it trained
            assert_stalls(run[mode], stalls[jobs, mode], loader=mode == "service")
        pids += run["service"]["service_pids"]
    assert_cleaned_up(tmp_path, pids)


def parsed(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.catalog = None
    return args


@pytest.mark.parametrize("jobs", ["0", "two", ""])
def test_train_rejects_bad_job_counts(jobs):
    with pytest.raises(SystemExit, match="--jobs .*give numbers of jobs"):
        train.run(parsed(train, "--jobs", jobs))


def test_e2e_rejects_unknown_competitors():
    with pytest.raises(SystemExit, match="Unknown competitor.*dataloders.*use service"):
        e2e.run(parsed(e2e, "--mode", "zygote", "--competitors", "service,dataloders"))


@pytest.mark.parametrize(("value", "problem"), [("0", "0 is not a count"), ("x", "'x' is not a")])
def test_benchmark_counts_must_be_positive(capsys, value, problem):
    """A zero count used to crash the run at its end (nothing timed to report)."""
    with pytest.raises(SystemExit):
        parsed(e2e, "--overhead-samples", value)
    assert f"--overhead-samples: {problem}" in capsys.readouterr().err


def test_bench_service_is_the_e2e_benchmark(capsys):
    """Issue 12 names the loader service's benchmark ``python -m benchmarks service``."""
    from benchmarks.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["service", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m benchmarks service")
    assert "End-to-end benchmark: four training jobs at once" in out


class _Cuda:
    type = "cuda"


@pytest.fixture
def broken_torchvision(monkeypatch):
    """torchvision built for another torch: its import fails as it does here with the
    registry's torchvision 0.28 ("operator torchvision::nms does not exist")."""
    import importlib.abc
    import importlib.util

    class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, self) if name == "torchvision" else None

        def exec_module(self, module):
            raise RuntimeError("operator torchvision::nms does not exist")

    for name in ("torchvision", "torchvision.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])


def test_train_falls_back_to_the_small_cnn_when_torchvision_does_not_match(
    broken_torchvision, capsys, monkeypatch
):
    import torch

    monkeypatch.setattr(torch.nn.Module, "to", lambda self, device: self)  # no GPU here
    model, name = train.build_model("auto", _Cuda())
    assert name == "tiny-cnn"
    assert isinstance(model, torch.nn.Sequential)
    assert "torchvision cannot be used with torch" in capsys.readouterr().err


def test_train_resnet18_names_a_torchvision_that_does_not_match(broken_torchvision):
    with pytest.raises(SystemExit, match="resnet18: torchvision cannot be used with torch .*nms"):
        train.build_model("resnet18", _Cuda())


def test_train_resnet18_runs_on_the_cpu_when_asked(monkeypatch):
    """``--model resnet18`` is torchvision's on any device (auto picks it only on a GPU)."""
    import types

    import torch

    models = types.ModuleType("torchvision.models")
    models.resnet18 = lambda num_classes: torch.nn.Linear(4, num_classes)
    monkeypatch.setitem(sys.modules, "torchvision", types.ModuleType("torchvision"))
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    cpu = torch.device("cpu")
    model, name = train.build_model("resnet18", cpu)
    assert (name, model.out_features) == ("resnet18", 10)
    assert train.build_model("auto", cpu)[1] == "tiny-cnn"
