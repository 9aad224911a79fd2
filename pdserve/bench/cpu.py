"""CPU time of the benchmark's processes, from their own kernel counters (psutil), per window.

Tells whether the gateway, the synthetic engine or the load generator ran out of CPU, and what
the gateway spends per relayed chunk. Reads counters only; starts and stops nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import psutil


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``processes``; one that has exited counts as nothing."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class CpuMeter:
    """Reads the CPU counters of named processes, each with the descendants it has when the
    meter is made (a gateway's workers). The load generator itself is ``psutil.Process()``.
    """

    def __init__(self, processes: Mapping[str, psutil.Process]) -> None:
        self._trees = {name: [process, *process.children(recursive=True)] for name, process in processes.items()}

    def read(self) -> dict[str, float]:
        """CPU seconds so far, by name."""
        return {name: cpu_seconds(tree) for name, tree in self._trees.items()}


@dataclass(frozen=True, slots=True)
class CpuUse:
    """The CPU one process (tree) used during one window of wall time."""

    seconds: float
    window_s: float

    @property
    def cores(self) -> float:
        """Average cores busy: 1.0 = one core all the time."""
        return self.seconds / self.window_s if self.window_s > 0 else 0.0


def cpu_use(before: Mapping[str, float], after: Mapping[str, float], *, window_s: float) -> dict[str, CpuUse]:
    """Each process's CPU between two ``CpuMeter.read()``s ``window_s`` apart. Pure."""
    return {name: CpuUse(seconds=after[name] - before[name], window_s=window_s) for name in before}


def summed(uses: list[CpuUse]) -> CpuUse:
    """Several windows of one process as one."""
    return CpuUse(seconds=sum(use.seconds for use in uses), window_s=sum(use.window_s for use in uses))


def per_item_us(cpu_s: float, items: int) -> float | None:
    """Microseconds of CPU per item (chunk, request); None when nothing was counted. Pure."""
    return cpu_s / items * 1e6 if items > 0 else None
