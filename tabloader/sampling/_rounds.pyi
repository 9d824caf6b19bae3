"""DependentSampler's round-by-round walk over several regions, in C.

``DependentSampler._rounds``'s loop, ~30x faster per round: the same uniforms, rows and
moves of rows between regions (the tests compare the two walks).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tabloader.sampling._regions import Regions

def rounds(
    regions: Regions,
    order: tuple[int, ...],
    counts: list[int],
    levels: list[list[int]],
    dec: list[list[int]],
    buf: list[float],
    bi: int,
    out: npt.NDArray[np.int64],
    /,
) -> int:
    """Run rounds of DependentSampler._rounds's loop over several regions.

    Job t's row of each round goes to out[t, round]; the picked rows move to their new
    regions (a region not seen yet is made by regions.region), as in the Python loop.

    Args:
        regions: The sampler's Regions: its rows, keys, index, pos and reg are read and
            written, looked up once per call.
        order: The job slots (each < 64), |R_j| ascending.
        counts: Each job's |R_j| before the first round.
        levels: regions.groups(order)[0].
        dec: regions.groups(order)[1].
        buf: Uniforms in [0, 1), at least 2 * m * n of them from bi.
        bi: The index in buf of the first uniform to use.
        out: int64 (m, n), C-contiguous, writable: m jobs of order, n rounds.

    Returns:
        The index in buf after the last uniform used.

    Raises:
        TypeError: An argument or an attribute of regions of the wrong type.
        ValueError: Sizes that do not fit together, or a job slot past 63.
        RuntimeError: Regions that contradict each other (a bug elsewhere).
    """
