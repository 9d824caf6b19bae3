"""The README and the manual (``docs/*.md``) say what tabloader does: their commands print what
they show, the README's two set-up commands are the demo and what CI runs, its training script
trains two jobs at once and resumes, and the paths and links the pages name exist.

Transcripts: every fenced block whose first line starts with ``$ `` is one. Each ``$ `` line is
run (a ``tabloader`` command: the installed one), and each line shown under it must be a line
of what it printed, with any spacing; ``…`` in a shown line stands for any text (paths,
timings, rows left out), a table's rule line matches any rule of as many columns, and a shown
``SomethingError: ...`` line means the command must fail. Each page's transcripts run in
order, in a scratch directory holding the demo's image folder ``demo-data/imagenet-3000``
(small images), each page with a default catalog of its own:

* the README's: as after its demo command (``tabloader demo``, on fewer images: the dataset
  ``imagenet`` and the demo's jobs);
* a ``docs/`` page's: a copy of the README's catalog after the README's transcripts, so the
  pages continue from its five minutes (the dataset ``photos``, the jobs ``cnn`` and ``vit``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tabloader.datagen import make_imagefolder
from tests.support.polling import wait_for

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
LAUNCHERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")

pytestmark = pytest.mark.xdist_group("docs")  # one worker builds the scratch catalogs once


def transcripts(text: str) -> list[tuple[str, list[str]]]:
    """(command, shown output lines) of every transcript block, in order."""
    out: list[tuple[str, list[str]]] = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
        lines = block.splitlines()
        if not lines or not lines[0].startswith("$ "):
            continue
        for line in lines:
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif line.strip():
                out[-1][1].append(line)
    return out


def shown_matches(shown: str, printed: list[str]) -> bool:
    """A shown line matches a printed one with any spacing; a table's rule (``----  ---``)
    matches any rule of as many columns (their widths follow values the page does not show)."""
    if re.fullmatch(r"-[- ]*", shown):
        return any(re.fullmatch(r"-[- ]*", line) and len(line.split()) == len(shown.split())
                   for line in printed)  # fmt: skip
    pattern = ".*".join(re.escape(" ".join(part.split())) for part in shown.split("…"))
    return any(re.fullmatch(pattern, " ".join(line.split())) for line in printed)


def environment(catalog: Path) -> dict[str, str]:
    """This process's environment with ``catalog`` as the default catalog, a service that
    stops 2 s after its last client, and no launcher's rank."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHERS}
    return {**env, "TABLOADER_CATALOG": str(catalog), "TABLOADER_IDLE_EXIT": "2"}


def tabloader(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    assert argv[0] == "tabloader", f"not a tabloader command: {command}"
    return subprocess.run(
        [str(Path(sys.executable).with_name("tabloader")), *argv[1:]],  # the installed command
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def first_mismatch(page: str, cwd: Path, env: dict[str, str]) -> str | None:
    """Run ``page``'s transcripts in order; the first command that did not print what the
    page shows, with what it printed (None: every one did)."""
    for command, shown in transcripts((ROOT / page).read_text()):
        done = tabloader(command, cwd, env)
        printed = (done.stdout + done.stderr).splitlines()
        errors = any(line.split(":")[0].endswith("Error") for line in shown)
        if (done.returncode != 0) != errors:
            return f"{page}: {command}: exit code {done.returncode}\n{done.stdout}{done.stderr}"
        for line in shown:
            if not shown_matches(line, printed):
                return f"{page}: {command}: not printed: {line}\nprinted: {printed}"
    return None


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A scratch directory as after the README's first set-up command, ``tabloader demo`` (on
    60 images), with the demo's image folder in small images; and what the demo printed."""
    root = tmp_path_factory.mktemp("docs")  # short: a service's socket goes under its catalog
    folder = root / "demo-data" / "imagenet-3000"
    make_imagefolder(folder, num_images=3000, num_classes=10, size=(40, 30))
    demo = "tabloader demo --images 60 --data demo-small"  # the README's, on fewer images
    return root, tabloader(demo, root, environment(root / "cat"))


@pytest.fixture(scope="module")
def after_readme(demo) -> tuple[str | None, Path]:
    """The README's transcripts run in the demo's catalog: (the first mismatch or None, a copy
    of the catalog after them, which the ``docs/`` pages continue from)."""
    root, done = demo
    assert done.returncode == 0, done.stdout + done.stderr
    mismatch = first_mismatch("README.md", root, environment(root / "cat"))
    return mismatch, Path(shutil.copytree(root / "cat", root / "after-readme"))


def test_the_pages_have_transcripts():
    found = {page: transcripts((ROOT / page).read_text()) for page in PAGES}
    commands = [command for command, _ in found["README.md"]]
    assert any("CREATE DATASET" in c for c in commands)
    assert any(c.endswith('"SHOW JOBS"') for c in commands)
    assert sum(bool(shown) for _, shown in found["README.md"]) >= 4  # outputs shown, so checked
    assert {"docs/statements.md", "docs/augment.md", "docs/weighted.md"} <= {
        page for page, found_here in found.items() if found_here
    }


BUCKET_PAGES = {"docs/object-storage.md": "my-bucket"}
"""Pages whose transcripts read a bucket: they run against the loopback S3 server (the ``s3``
fixture's environment) with that bucket made."""


@pytest.mark.parametrize("page", [p for p in PAGES if transcripts((ROOT / p).read_text())])
def test_every_command_prints_what_the_page_shows(page, demo, after_readme, request):
    readme_mismatch, after = after_readme
    if page == "README.md":
        assert readme_mismatch is None, readme_mismatch
        return
    assert readme_mismatch is None, f"the README's commands, which {page} continues, failed"
    root, _ = demo
    if page in BUCKET_PAGES:
        s3 = request.getfixturevalue("s3")  # (sets the AWS environment the commands inherit)
        s3.client.create_bucket(Bucket=BUCKET_PAGES[page])
    catalog = shutil.copytree(after, root / page.replace("/", "-"))
    mismatch = first_mismatch(page, root, environment(Path(catalog)))
    assert mismatch is None, mismatch


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_readme_is_a_front_page_of_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    assert "## Documentation" in lines


def test_the_two_set_up_commands_are_the_demo_and_what_ci_runs():
    commands = re.findall(r"^```bash\n(.*?)\n```", readme_section("Set up"), flags=re.M | re.S)
    assert len(commands) == 2, commands
    demo, suite = commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == suite  # .ci/run's one command, after its set -e and cd
    install = "python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && "
    assert suite.startswith(install)
    assert demo.startswith(install)
    assert demo.endswith(" && pip install -q -e . && tabloader demo")


def test_the_demo_command_imports_registers_and_loads_three_jobs(demo):
    _, done = demo
    assert done.returncode == 0, done.stderr
    served, jobs, decoded = map(
        int, re.search(r"(\d+) images served to (\d+) jobs .* decoded (\d+)", done.stdout).groups()
    )
    union = int(re.search(r"the union is (\d+) rows", done.stdout).group(1))
    assert jobs == 3
    assert decoded == union < served  # one decode per row of any job, shared by the jobs


def readme_script(name: str) -> str:
    """The README's Python block that starts with the comment ``# <name>:``."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    (script,) = [block for block in blocks if block.startswith(f"# {name}:")]
    return script


def test_the_readme_training_script_trains_two_jobs_at_once_and_resumes(demo, after_readme):
    """``python train.py cnn & python train.py vit; wait`` in the catalog of the README's five
    minutes: three epochs each through one auto-started service; run again, a script resumes
    from its checkpoint in its last epoch."""
    root, _ = demo
    work = root / "train"
    catalog = Path(shutil.copytree(after_readme[1], work / "cat"))
    (work / "train.py").write_text(readme_script("train.py"))
    # one torch thread: on 2 cores beside the suite's other worker, torch's spinning threads
    # took 2.5 s of CPU a script, twice what the script does
    env = {**environment(catalog), "OMP_NUM_THREADS": "1"}

    def launch(job: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "train.py", job], cwd=work, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    def service_stopped() -> None:  # so that no run meets a service stopping as it connects
        sockets = catalog / ".service"
        assert (sockets / "service.log").is_file()  # it ran there (a short path), not in /tmp
        wait_for(lambda: not any(p.is_socket() for p in sockets.glob("*")), "the service to stop")

    procs = {job: launch(job) for job in ("cnn", "vit")}
    for job, proc in procs.items():
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err[-3000:]
        assert out.splitlines() == [f"{job} epoch {epoch} done" for epoch in range(3)]
    service_stopped()
    again = launch("cnn")
    out, err = again.communicate(timeout=TIMEOUT)
    assert again.returncode == 0, err[-3000:]
    assert out.splitlines() == ["cnn epoch 2 done"]  # epochs 0 and 1 were done
    service_stopped()


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_the_paths_and_links_a_page_names_exist(page):
    text = (ROOT / page).read_text()
    named = re.findall(r"`((?:tabloader|benchmarks|tests|examples|docs|\.ci)/[\w./-]*)`", text)
    missing = [path for path in named if not (ROOT / path).exists()]
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        path = (ROOT / page).parent / file if file else ROOT / page
        if not path.exists() or (anchor and anchor not in anchors(path)):
            missing.append(target)
    assert not missing, f"{page} names what is not there: {missing}"
