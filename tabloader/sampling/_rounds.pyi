"""The dependent sampler's walk over several regions (``_rounds.c``), as ``_rounds`` in Python."""

from __future__ import annotations

from typing import Any

def rounds(*args: Any) -> int:
    """Run rounds for the job slots given, as ``DependentSampler._rounds``'s loop; the index of
    the first uniform not used."""
