"""The analysis' defaults, which the CLI's parser reads without importing the analysis."""

from __future__ import annotations

DEFAULT_BATCHES = 20
"""The fewest batches the runs read unless told (more while a run takes under ``seconds``)."""
DEFAULT_SECONDS = 2.0
"""The shortest the first run reads unless told (CPU is counted in 10 ms ticks): the cached
run reads its rows again for half of it, the cached_step run for three quarters."""
