"""Where a job's time goes, and what would help: DS-Analyzer's method for tabloader.

:func:`profile_job` measures a registered job by differential runs (:mod:`._profile`),
:func:`rates_of` turns them into the rates of the model (:mod:`._model`), and :func:`predict`
gives the seconds per epoch and stall fraction of other configurations (``WhatIf``: decode
processes, cache size, jobs sharing, storage bandwidth, cores, the loop's step).
:func:`analyze` does all three and :func:`plot_analysis` draws the result;
``tabloader analyze JOB`` prints them; ``docs/analyze.md`` explains the figures and the model.
"""

from __future__ import annotations

from tabloader.analyze._model import Prediction, Rates, WhatIf, parse_what_if, predict
from tabloader.analyze._plot import plot_analysis
from tabloader.analyze._profile import (
    DEFAULT_BATCHES,
    DEFAULT_SECONDS,
    Profile,
    Run,
    profile_job,
    rates_of,
)
from tabloader.analyze._report import Analysis, analyze

__all__ = [
    "DEFAULT_BATCHES",
    "DEFAULT_SECONDS",
    "Analysis",
    "Prediction",
    "Profile",
    "Rates",
    "Run",
    "WhatIf",
    "analyze",
    "parse_what_if",
    "plot_analysis",
    "predict",
    "profile_job",
    "rates_of",
]
