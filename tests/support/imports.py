"""What a fresh interpreter imports: the modules that start-up paths must leave out."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable


def imported_after(code: str, modules: Iterable[str]) -> list[str]:
    """Those of ``modules`` that a fresh interpreter has imported once it ran ``code``."""
    names = tuple(modules)
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {names!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.split()
