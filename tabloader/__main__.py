"""``python -m tabloader``."""

from __future__ import annotations

from tabloader.cli import main

raise SystemExit(main())
