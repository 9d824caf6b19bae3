"""The commands of the README and of the manual (``docs/*.md``) print what they show.

Every fenced block whose first line starts with ``$ `` is a transcript: each ``$ `` line is run
(in order, through the whole README, then each page of ``docs/`` in name order, in one scratch
directory with its own default catalog and the demo's image folder), and each line shown under
it must be a line of what it printed. ``…`` in a shown line stands for any text (paths,
timings).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tabloader.datagen import make_imagefolder

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the order they run in


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
    pattern = ".*".join(re.escape(" ".join(part.split())) for part in shown.split("…"))
    return any(re.fullmatch(pattern, " ".join(line.split())) for line in printed)


def test_the_readme_has_transcripts():
    found = transcripts((ROOT / "README.md").read_text())
    commands = [c for c, _ in found]
    assert any("CREATE DATASET" in c for c in commands)
    assert any(c.endswith('"SHOW JOBS"') for c in commands)
    assert sum(bool(shown) for _, shown in found) >= 5  # outputs shown, so checked


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory as after the README's set-up: the demo's image folder (small images, as
    many as the demo makes) and a default catalog of its own, holding the demo's dataset."""
    root = tmp_path_factory.mktemp("readme")
    make_imagefolder(
        root / "demo-data" / "imagenet-3000", num_images=3000, num_classes=10, size=(40, 30)
    )
    home = root / "home-catalog"  # not ./catalog: `python -m` would import it as the package
    env = {**os.environ, "TABLOADER_CATALOG": str(home), "TABLOADER_IDLE_EXIT": "2"}
    setup = "CREATE DATASET imagenet FROM 'demo-data/imagenet-3000' FORMAT imagefolder"
    assert run(f'tabloader sql "{setup}"', root, env).returncode == 0
    return root, env


def run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
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


def test_every_readme_command_prints_what_the_readme_shows(scratch):
    root, env = scratch
    commands = [c for page in PAGES for c in transcripts(page.read_text())]
    assert any("--prometheus" in c for c, _ in commands)  # docs/metrics.md's: the pages run
    for command, shown in commands:
        done = run(command, root, env)
        printed = (done.stdout + done.stderr).splitlines()
        errors = any(line.split(":")[0].endswith("Error") for line in shown)
        assert (done.returncode != 0) == errors, f"{command}\n{done.stdout}{done.stderr}"
        for line in shown:
            assert shown_matches(line, printed), f"{command}: not printed: {line}\n{printed}"
