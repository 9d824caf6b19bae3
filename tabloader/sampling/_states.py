"""The layouts of the samplers' ``state_dict``: plain dicts of numbers and bytes (bitmaps
serialized, arrays as their bytes), one ``TypedDict`` each, in one module that imports no
sampler (each sampler and the ``Sampler`` protocol name them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypedDict

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from typing_extensions import NotRequired


class UniformsState(TypedDict):
    """:meth:`~tabloader.sampling._base.Uniforms.state_dict`: the generator's state, the
    unread floats (float64)."""

    bit_generator: Mapping[str, Any]
    buffer: bytes


class RegionsState(TypedDict):
    """:meth:`~tabloader.sampling._regions.Regions.state_dict`: per region its key and its
    rows (uint32, in pick order), and the size of the row -> region map."""

    keys: list[int]
    rows: list[bytes]
    size: int


class WeightedJobState(TypedDict):
    """One job of :class:`WeightedState`: its ids (a serialized bitmap), static weights
    (float64) or importance scores, its epoch and draws ``left`` (with replacement) or rows
    not drawn yet (``live``, packed bits: without), and each epoch's frozen ``q`` (float64)."""

    name: str
    seq: int
    ids: bytes
    weights: bytes | None
    scores: Mapping[str, Any] | None  # ImportanceScores.state_dict()
    replacement: bool
    epoch: int
    left: int
    live: bytes | None
    past: dict[int, bytes]


class WeightedState(TypedDict):
    """:meth:`~tabloader.sampling._weighted.WeightedJobs.state_dict`."""

    entropy: int
    key: int
    round: int
    rng: UniformsState
    jobs: list[WeightedJobState]


class DependentJobState(TypedDict):
    """One plain job of :class:`DependentState`."""

    name: str
    slot: int
    seq: int
    epoch: int
    count: int  # |R_j|
    ids: bytes  # a serialized bitmap


class DependentState(TypedDict):
    """:meth:`~tabloader.sampling.DependentSampler.state_dict`: its plain jobs, their regions
    and uniforms, and its weighted jobs (absent from states saved before those)."""

    kind: Literal["dependent"]
    version: int
    next_seq: int
    jobs: list[DependentJobState]
    regions: RegionsState
    rng: UniformsState
    weighted: NotRequired[WeightedState]


class IndependentJobState(TypedDict):
    """One plain job of :class:`IndependentState`."""

    name: str
    seq: int
    epoch: int
    ptr: int  # rows of ``perm`` read
    perm: bytes  # the epoch's permutation (uint32)
    ids: bytes  # a serialized bitmap
    rng: Mapping[str, Any]  # the job's bit generator's state


class IndependentState(TypedDict):
    """:meth:`~tabloader.sampling.IndependentSampler.state_dict`: its seed's entropy, its
    plain jobs and its weighted jobs (each with streams of its own; absent from states saved
    before those)."""

    kind: Literal["independent"]
    version: int
    entropy: int | Sequence[int] | None  # the seed sequence's: an int for an int seed
    next_seq: int
    jobs: list[IndependentJobState]
    weighted: NotRequired[dict[str, WeightedState]]


SamplerState = DependentState | IndependentState
"""What a sampler's ``state_dict`` returns (its ``kind`` says which)."""


class Drawn(NamedTuple):
    """A weighted job's draws at a step of its run (a state's, to resume with the same
    draws): the rows drawn after the step already, by epoch (``segments``), then where the
    holder's stream of uniforms stands (``entropy``, ``key``, ``round``: its uniforms are a
    function of those), and the ranks of an importance job's scores that its epochs from the
    step's froze (``frozen``)."""

    entropy: int
    key: int
    round: int
    segments: list[tuple[int, npt.NDArray[np.int64]]]
    frozen: Mapping[int, npt.NDArray[np.int32]]
