"""``tabloader analyze --plot FILE.png``: the predicted stall fraction against decode processes
(cores used) and against the cache's size, the analysed configuration and the ``--what-if``
configurations marked.

matplotlib is imported here, on first use, and only here (the product does not need it; the
``bench`` extra installs it).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tabloader.analyze._model import WhatIf, predict

if TYPE_CHECKING:
    from tabloader.analyze._report import Analysis


def plot_analysis(analysis: Analysis, path: str | os.PathLike[str]) -> None:
    """Write the plot of ``analysis`` to ``path`` (any format matplotlib knows by suffix).

    Raises:
        ImportError: matplotlib is not installed (with the command that installs it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "tabloader analyze --plot draws with matplotlib: pip install matplotlib"
        ) from exc
    rates, epochs = analysis.rates, analysis.epochs
    fig, (by_workers, by_cache) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    workers = list(range(1, 2 * max(1, int(rates.cores)) + 1))
    decoded = rates.rows * rates.value_bytes * rates.values_per_row
    fractions = [2.0**k for k in range(-6, 2)]
    for jobs in sorted({1, *(p.what_if.jobs or 1 for p in analysis.predictions)}):
        label = f"{jobs} job{'s' if jobs > 1 else ''}"
        by_workers.plot(
            workers,
            [_stall(analysis, WhatIf(workers=w, jobs=jobs)) for w in workers],
            marker=".",
            label=label,
        )
        by_cache.plot(
            [f * 100 for f in fractions],
            [
                _stall(analysis, WhatIf(cache_bytes=max(1 << 20, int(f * decoded)), jobs=jobs))
                for f in fractions
            ],
            marker=".",
            label=label,
        )
    for p in reversed(analysis.predictions):  # the analysed one last: on top
        w = p.what_if
        label = w.label()
        style = {"marker": "o", "s": 60} if label else {"marker": "*", "s": 200, "c": "black"}
        by_workers.scatter([w.workers or rates.workers], [p.stall_fraction], zorder=3, **style)
        cache = (w.cache_bytes or rates.cache_bytes) / decoded * 100 if decoded else 0.0
        by_cache.scatter(
            [cache], [p.stall_fraction], zorder=3, label=label or "as analysed", **style
        )
    by_workers.set(xlabel="decode processes", ylabel=f"stall fraction ({epochs} epoch(s))")
    by_cache.set(xlabel="cache, % of the job's decoded rows", xscale="log")
    by_workers.set_title("against decode processes (cores)")
    by_cache.set_title("against the cache")
    for ax in (by_workers, by_cache):
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"tabloader analyze {analysis.profile.job}: predicted stall fraction")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _stall(analysis: Analysis, what_if: WhatIf) -> float:
    return predict(analysis.rates, what_if, epochs=analysis.epochs).stall_fraction
