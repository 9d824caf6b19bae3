"""A target's verdict row, as ``bench throughput`` and its scenarios print and write it."""

from __future__ import annotations

from typing import TypedDict

__all__ = ["Verdict", "verdict"]


class Verdict(TypedDict):
    """One row of a targets table: the measured ``ratio`` against its ``target``."""

    check: str
    ratio: str
    target: str
    result: str


def verdict(check: str, value: float, limit: float, *, at_most: bool = False) -> Verdict:
    """``value`` against ``limit`` (at least it, or ``at_most``)."""
    ok = value <= limit if at_most else value >= limit
    return {
        "check": check,
        "ratio": f"{value:.2f}",
        "target": f"{'<=' if at_most else '>='} {limit}",
        "result": "PASS" if ok else "FAIL",
    }
