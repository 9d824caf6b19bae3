"""Where a job's time goes, and what would help: DS-Analyzer's method for tabloader.

:func:`profile_job` measures a registered job by differential runs (:mod:`._profile`),
:func:`rates_of` turns them into the rates of the model (:mod:`._model`), and :func:`predict`
gives the seconds per epoch and stall fraction of other configurations (``WhatIf``: decode
processes, cache size, jobs sharing, storage bandwidth, cores, the loop's step).
:func:`analyze` does all three and :func:`plot_analysis` draws the result;
``tabloader analyze JOB`` prints them; ``docs/analyze.md`` explains the figures and the model.
"""

from __future__ import annotations

import typing

from tabloader._lazy import lazy_names
from tabloader.analyze._defaults import DEFAULT_BATCHES, DEFAULT_SECONDS

if typing.TYPE_CHECKING:
    from tabloader.analyze._model import Prediction as Prediction
    from tabloader.analyze._model import Rates as Rates
    from tabloader.analyze._model import WhatIf as WhatIf
    from tabloader.analyze._model import parse_what_if as parse_what_if
    from tabloader.analyze._model import predict as predict
    from tabloader.analyze._plot import plot_analysis as plot_analysis
    from tabloader.analyze._profile import Profile as Profile
    from tabloader.analyze._profile import Run as Run
    from tabloader.analyze._profile import profile_job as profile_job
    from tabloader.analyze._profile import rates_of as rates_of
    from tabloader.analyze._report import Analysis as Analysis
    from tabloader.analyze._report import analyze as analyze

# Imported on first use: the CLI's parser reads the defaults above for every command, and the
# rest (numpy, the engine, the service's client) cost each ``tabloader`` command 0.1-0.2 s.
_LAZY = {
    **dict.fromkeys(
        ("Prediction", "Rates", "WhatIf", "parse_what_if", "predict"), "tabloader.analyze._model"
    ),
    "plot_analysis": "tabloader.analyze._plot",
    **dict.fromkeys(("Profile", "Run", "profile_job", "rates_of"), "tabloader.analyze._profile"),
    **dict.fromkeys(("Analysis", "analyze"), "tabloader.analyze._report"),
}

__getattr__ = lazy_names(__name__, _LAZY)

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
