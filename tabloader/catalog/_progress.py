"""The one wrapper around tqdm: progress bars on stderr, off when not a terminal or disabled.

Set ``TABLOADER_DISABLE_PROGRESS_BARS=1`` or call ``disable_progress_bars()`` to silence them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_disabled = False


def disable_progress_bars() -> None:
    """Turn progress bars off for this process."""
    global _disabled
    _disabled = True


def enable_progress_bars() -> None:
    """Turn progress bars back on (they still only show on a terminal)."""
    global _disabled
    _disabled = False


def _off() -> bool:
    env = os.environ.get("TABLOADER_DISABLE_PROGRESS_BARS", "").lower()
    return _disabled or env in ("1", "true", "yes") or not sys.stderr.isatty()


def progress_bar(*, total: int | None, desc: str, unit: str = "rows") -> Any:
    """Return a tqdm bar (or a silent stand-in with the same ``update``/``close``)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        disable=_off(),
        file=sys.stderr,
        leave=False,
    )
