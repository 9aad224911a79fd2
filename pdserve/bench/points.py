"""One measured point of a sweep: a target at a load level, with its summary.

Pure data, below everything that produces points (sweep, compare) and everything that
renders them (report, plot), so none of those has to import another to share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.stats import Summary


@dataclass(frozen=True, slots=True)
class Point:
    """One target at one load level (a request rate, or a number of concurrent streams)."""

    target: str
    load: float
    summary: Summary
